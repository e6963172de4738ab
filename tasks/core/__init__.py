"""What every layer uses: one-line errors, the folders ppl-audit keeps things in, the console, whole files."""
