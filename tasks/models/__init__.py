"""The models: where each is, how it loads, its format, its placement over devices, and quantizing one here."""
