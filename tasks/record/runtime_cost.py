"""The runtime's own cost: one GGUF file scored twice, dequantized in transformers (what its weights lost) and in
llama.cpp (what it loses as served, 8-bit activations and llama.cpp's kernels included). Both rows score the same
tokens, so their difference is measured paired, with its interval, as a variant's against the baseline."""

from __future__ import annotations

from tasks.engine.paired import paired_difference
from tasks.record.reference_said import StreamDifference
from tasks.record.results import VariantResult
from tasks.record.runtime_cost_said import RuntimeCost


def runtime_costs(variants: list[VariantResult]) -> list[dict]:
    """For each variant llama.cpp scored whose file a transformers variant of the audit also scored on the same
    tokens: ``{"served", "weights", "file", delta_ppl_pct[...]...}``: ΔPPL of the served row against the other."""
    found = []
    for served in variants:
        if not (served.ok and served.facts.quantization.get("runtime") == "llama.cpp"):
            continue
        for weights in variants:
            same = (weights.ok and weights is not served and weights.facts.source == served.facts.source
                    and weights.facts.quantization.get("runtime") != "llama.cpp")
            if not same or len(weights.result.token_nll) != len(served.result.token_nll) \
                    or served.result.scored_windows is not None or weights.result.scored_windows is not None:
                continue
            found.append({"served": served.name, "weights": weights.name, "file": served.facts.source,
                          **paired_difference(weights.result.token_nll, served.result.token_nll,
                                              served.result.window_tokens)})
    return found


def runtime_cost_lines(costs: list[dict]) -> list[str]:
    """One line per cost, as the console and the report say it."""
    return [_cost_line(RuntimeCost.of_record(cost)) for cost in costs]


def _cost_line(cost: RuntimeCost) -> str:
    """The served row's paired change against the weights'."""
    pct = cost.change.delta_ppl_pct
    return (f"runtime cost: {cost.served} (llama.cpp) against {cost.weights} (the same file dequantized in "
            f"transformers): ΔPPL {pct.value:+.2f}% [{pct.low:+.2f}, {pct.high:+.2f}] over {cost.change.windows} windows")


def stream_line(differ: dict | None) -> list[str]:
    """What the stream as served is, where llama.cpp's tokenizer of the file parts from transformers' (none where
    they agree)."""
    if not differ:
        return []
    said = StreamDifference.of_record(differ)
    return [f"tokens: llama.cpp's tokenizer of the served file gives {said.llama_cpp_tokens:,} tokens where "
            f"transformers' gives {said.transformers_tokens:,}, first different at token "
            f"{said.first_difference:,}; every model scored llama.cpp's stream"]
