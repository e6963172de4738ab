"""A mixed-precision recipe under a size budget, chosen from measured gains (``ppl-audit tune``).

A variant's decoder-layer matrices are the units a recipe can give more precision: a whole layer, or its fused
groups (q/k/v, the output projection, gate/up, down), each with one choice, as runtimes fuse them. For a GGUF
variant each option is a GGUF tensor type above the variant's (``Q6_K``, ``Q8_0``, ``F16``): llama.cpp quantizes
every tensor on its own, so the variant with a unit's tensors taken from the uniform file of that type *is* the
recipe's model, bit for bit. For a gptq variant an option is 8 bits, a smaller group or unquantized (``gptq``), made
by gptqmodel's ``dynamic``; GPTQ corrects each layer with what the layers before it pass on, so the recipe is close
to the swapped models, and is proven as built.

What a unit at an option wins back is measured on a seeded sample of the audit's windows (every domain's), as the KL
to the baseline it removes; its cost is exact, read from the files' headers (a GGUF file's, a gptq checkpoint's
layout costed from the baseline's shapes). A multiple-choice knapsack picks the
assignment of most gain within the budget; the combination is then scored as a whole (gains do not add), and refined
by scoring its neighbours (the best assignment with one of its choices left out) and keeping the best measured.
"""
