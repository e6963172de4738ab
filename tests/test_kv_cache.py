"""A quantized key/value cache: the number formats against direct computations, an attention layer against one built
by hand, a cache that stores exactly changes nothing, and a whole audit with its figures and its bad settings."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import flat, write_config

from flows.audit import audit, result_of
from flows.cli import main
from tasks.engine.kv_cache import KVCacheFormat, cache, residual_mask
from tasks.engine.perplexity import perplexity
from tasks.engine.scoring_options import ScoreOptions, Windowing
from tasks.models.variants import cache_format, load_variant

pytestmark = pytest.mark.usefixtures("prefect_harness")


def q8_0(x: np.ndarray, group: int) -> np.ndarray:
    """llama.cpp's quantize_row_q8_0_ref then dequantize_row_q8_0, in float32."""
    blocks = x.astype(np.float32).reshape(-1, group)
    out = np.empty_like(blocks)
    for i, block in enumerate(blocks):
        d = np.float32(np.abs(block).max() / np.float32(127))
        inverse = np.float32(1) / d if d else np.float32(0)
        q = np.array([math.copysign(math.floor(abs(v) + 0.5), v) for v in block * inverse], np.float32)  # roundf
        out[i] = q * np.float32(np.float16(d))
    return out.reshape(x.shape)


def q4_0(x: np.ndarray, group: int) -> np.ndarray:
    """llama.cpp's quantize_row_q4_0_ref then dequantize_row_q4_0, in float32."""
    blocks = x.astype(np.float32).reshape(-1, group)
    out = np.empty_like(blocks)
    for i, block in enumerate(blocks):
        largest = block[np.abs(block).argmax()]
        d = np.float32(largest / np.float32(-8))
        inverse = np.float32(1) / d if d else np.float32(0)
        q = np.array([min(15, int(v)) for v in block * inverse + np.float32(8.5)], np.float32)  # (int8_t) truncates
        out[i] = (q - 8) * np.float32(np.float16(d))
    return out.reshape(x.shape)


def fp8_values(exponent_bits: int, mantissa_bits: int, finite_nan_only: bool) -> np.ndarray:
    """Every finite value of an fp8 format, from its definition (IEEE-like, with subnormals; e4m3fn keeps its top
    exponent for numbers, all but the pattern with every mantissa bit set)."""
    bias = 2 ** (exponent_bits - 1) - 1
    values = []
    for exponent in range(2**exponent_bits):
        for mantissa in range(2**mantissa_bits):
            top = exponent == 2**exponent_bits - 1
            if top and (not finite_nan_only or mantissa == 2**mantissa_bits - 1):
                continue
            fraction = mantissa / 2**mantissa_bits
            values.append((fraction if exponent == 0 else 1 + fraction) * 2.0 ** ((exponent or 1) - bias))
    return np.array(sorted({v for v in values} | {-v for v in values}))


def nearest(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Each value saturated to the grid's range and rounded to its nearest point (ties are not met by these inputs)."""
    clipped = np.clip(x, grid[0], grid[-1])
    at = np.abs(clipped.reshape(-1, 1) - grid.reshape(1, -1))
    assert (np.sort(at, axis=1)[:, 1] - at.min(axis=1) > 1e-12).all(), "a tie: pick other inputs"
    return grid[at.argmin(axis=1)].reshape(x.shape)


@pytest.fixture(scope="module")
def keys() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    scale = torch.logspace(-3, 2.5, 64)  # small and large values, beyond e4m3's 448 too
    return torch.randn(2, 3, 5, 64, generator=generator) * scale


@pytest.mark.parametrize("dtype, group", [("int8", 32), ("int8", 16), ("int4", 32), ("int4", 8)])
def test_int_caches_round_trip_as_llama_cpp_s_reference_code(keys, dtype, group):
    found = KVCacheFormat(dtype, group).round_trip(keys).numpy()
    expected = (q8_0 if dtype == "int8" else q4_0)(keys.numpy(), group)
    np.testing.assert_array_equal(found, expected)
    assert np.abs(found - keys.numpy()).max() > 0  # it did quantize


@pytest.mark.parametrize("dtype, exponent, mantissa, fn", [("fp8_e4m3", 4, 3, True), ("fp8_e5m2", 5, 2, False)])
def test_fp8_caches_round_to_the_nearest_value_of_the_format_saturating(keys, dtype, exponent, mantissa, fn):
    found = KVCacheFormat(dtype).round_trip(keys.double()).numpy()
    np.testing.assert_array_equal(found, nearest(keys.double().numpy(), fp8_values(exponent, mantissa, fn)))


@torch.no_grad()
def test_an_attention_layer_attends_to_the_cache_s_keys_and_values_as_one_built_by_hand(trained_model_dir):
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = AutoModelForCausalLM.from_pretrained(trained_model_dir, dtype=torch.float64)
    form, layer = KVCacheFormat("int4", 16), model.model.layers[1].self_attn
    x = torch.randn(2, 24, model.config.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    positions = torch.arange(24).unsqueeze(0)
    cos, sin = model.model.rotary_emb(x, positions)
    mask = torch.full((24, 24), -torch.inf, dtype=torch.float64).triu(1)[None, None]
    found, _ = layer(x, position_embeddings=(cos, sin), attention_mask=mask, past_key_values=cache(form))

    heads, kv_heads, width = model.config.num_attention_heads, model.config.num_key_value_heads, layer.head_dim
    q = layer.q_proj(x).view(2, 24, heads, width).transpose(1, 2)
    k = layer.k_proj(x).view(2, 24, kv_heads, width).transpose(1, 2)
    v = layer.v_proj(x).view(2, 24, kv_heads, width).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = torch.from_numpy(q4_0(k.numpy(), 16)).double().repeat_interleave(heads // kv_heads, 1)  # stored: after RoPE
    v = torch.from_numpy(q4_0(v.numpy(), 16)).double().repeat_interleave(heads // kv_heads, 1)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(width) + mask, dim=-1)
    by_hand = layer.o_proj((weights @ v).transpose(1, 2).reshape(2, 24, heads * width))
    torch.testing.assert_close(found, by_hand, rtol=1e-9, atol=1e-9)
    unquantized, _ = layer(x, position_embeddings=(cos, sin), attention_mask=mask)
    assert (found - unquantized).abs().max() > 1e-4


@torch.no_grad()
@pytest.mark.parametrize("residual", [1, 5])
def test_with_a_residual_each_query_sees_its_newest_keys_as_computed_and_older_ones_quantized(trained_model_dir,
                                                                                               residual):
    """transformers' QuantizedCache layout, against attention built by hand from both copies of keys and values."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = AutoModelForCausalLM.from_pretrained(trained_model_dir, dtype=torch.float64)
    form, layer, n = KVCacheFormat("int4", 16, residual), model.model.layers[0].self_attn, 20
    x = torch.randn(2, n, model.config.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    cos, sin = model.model.rotary_emb(x, torch.arange(n).unsqueeze(0))
    found, _ = layer(x, position_embeddings=(cos, sin), past_key_values=cache(form),
                     attention_mask=residual_mask(None, n, residual, 2, torch.float64, torch.device("cpu")))

    heads, kv_heads, width = model.config.num_attention_heads, model.config.num_key_value_heads, layer.head_dim
    q = layer.q_proj(x).view(2, n, heads, width).transpose(1, 2)
    k = layer.k_proj(x).view(2, n, kv_heads, width).transpose(1, 2)
    v = layer.v_proj(x).view(2, n, kv_heads, width).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    copies = {"computed": (k, v), "stored": (torch.from_numpy(q4_0(k.numpy(), 16)).double(),
                                             torch.from_numpy(q4_0(v.numpy(), 16)).double())}
    behind = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    scores, values = {}, {}
    for name, (keys, vals) in copies.items():
        keys, vals = keys.repeat_interleave(heads // kv_heads, 1), vals.repeat_interleave(heads // kv_heads, 1)
        scores[name], values[name] = q @ keys.transpose(-1, -2) / math.sqrt(width), vals
    recent = (behind >= 0) & (behind < residual)
    combined = torch.where(recent, scores["computed"], scores["stored"]).masked_fill(behind < 0, -torch.inf)
    weights = torch.softmax(combined, dim=-1)
    by_hand = (weights * recent) @ values["computed"] + (weights * (behind >= residual)) @ values["stored"]
    by_hand = layer.o_proj(by_hand.transpose(1, 2).reshape(2, n, heads * width))
    torch.testing.assert_close(found, by_hand, rtol=1e-9, atol=1e-9)


def test_a_cache_that_stores_exactly_changes_nothing_and_batching_changes_nothing(trained_model_dir, tokenizer, text):
    from tasks.config import VariantSpec
    from tasks.data.corpus import tokenize

    stream = tokenize(text, tokenizer, max_tokens=700)
    plain, facts = load_variant(VariantSpec(name="plain"), str(trained_model_dir))
    exact_spec = VariantSpec(name="exact", kv_cache={"dtype": "float32"})
    exact, exact_facts = load_variant(exact_spec, str(trained_model_dir))
    a = perplexity(plain, stream, Windowing(64, 32), 4)
    b = perplexity(exact, stream, Windowing(64, 32), 4, ScoreOptions(kv_cache=cache_format(exact_spec)))
    assert a.nll_sum == b.nll_sum and torch.equal(torch.as_tensor(a.token_nll), torch.as_tensor(b.token_nll))
    assert exact_facts.kv_bytes_per_token == facts.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4  # K and V, 2 layers
    four_spec = VariantSpec(name="int4", kv_cache={"dtype": "int4"})
    four, four_facts = load_variant(four_spec, str(trained_model_dir))
    int4 = ScoreOptions(kv_cache=cache_format(four_spec))
    once, batched = (perplexity(four, stream, Windowing(64, 32), batch, int4) for batch in (1, 7))
    assert once.nll_sum == batched.nll_sum and once.nll_sum != a.nll_sum
    # the format is the call's, not the model's: loaded for an int4 cache, the model without one scores as the plain
    assert perplexity(four, stream, Windowing(64, 32), 4).nll_sum == a.nll_sum
    all_quantized = once.nll_sum
    assert four_facts.kv_bytes_per_token == 2 * 2 * 2 * 32 * (4 + 16 / 32) / 8
    assert four_facts.kv_cache == "int4 g32 (llama.cpp q4_0)"
    # a residual as long as the window keeps every key as computed; a shorter one, padded batches and all, is its own
    kept_spec = VariantSpec(name="kept", kv_cache={"dtype": "int4", "residual": 64})
    whole, _ = load_variant(kept_spec, str(trained_model_dir))
    assert perplexity(whole, stream, Windowing(64, 32), 3, ScoreOptions(kv_cache=cache_format(kept_spec))).nll_sum \
        == a.nll_sum
    some_spec = VariantSpec(name="some", kv_cache={"dtype": "int4", "residual": 8})
    some, some_facts = load_variant(some_spec, str(trained_model_dir), window=64)
    residual = ScoreOptions(kv_cache=cache_format(some_spec))
    # over the audit's window of 64, its 8 newest tokens take the model's float32, the other 56 int4's 144 bytes
    assert some_facts.kv_bytes_per_token == (56 * 144 + 8 * 1024) / 64
    once, batched = (perplexity(some, stream, Windowing(64, 32), batch, residual) for batch in (1, 7))
    assert once.nll_sum == pytest.approx(batched.nll_sum, rel=1e-12)
    assert once.nll_sum not in (a.nll_sum, all_quantized)


@pytest.mark.slow  # a whole audit of three cached variants
def test_an_audit_reports_each_cache_its_cost_and_its_paired_loss(tmp_path, cache_dir, trained_model_dir, corpus_path):
    config = write_config(tmp_path / "kv.yaml", trained_model_dir, corpus_path,
                          [{"name": "kv8", "kv_cache": {"dtype": "int8"}}, {"name": "kv4", "kv_cache": {"dtype": "int4"}},
                           {"name": "int8-kv-fp8", "method": "torchao-int8", "kv_cache": {"dtype": "fp8_e5m2"}}],
                          name="kv", thresholds={"max_ppl_increase_pct": 50},
                          tracking={"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "kv"})
    summary = result_of(audit(config=str(config), return_state=True))
    rows = {row["variant"]: row for row in flat(summary.rows)}
    assert rows["kv8"]["method"] == "baseline kv:int8" and rows["int8-kv-fp8"]["method"] == "torchao-int8 kv:fp8_e5m2"
    assert rows["kv8"]["kv_saving_pct"] == pytest.approx(100 * (1 - 8.5 / 32))
    assert rows["kv4"]["kv_saving_pct"] == pytest.approx(100 * (1 - 4.5 / 32))
    for name in ("kv8", "kv4"):  # paired against the baseline on the same tokens, KL from its reference
        row = rows[name]
        assert row["delta_ppl_pct_low"] <= row["delta_ppl_pct"] <= row["delta_ppl_pct_high"] and row["kld_mean"] > 0
    assert rows["kv4"]["kld_mean"] > rows["kv8"]["kld_mean"]
    said = "KV cache int8 g32 (llama.cpp q8_0): 272 B/token, 0.02 MiB a window, 73% less than the baseline's"
    assert said in summary.table and rows["kv8"]["kv_window_mib"] == 272 * 64 / 2**20
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = {r.data.tags["ppl_audit.variant"]: r for r in client.search_runs(
        [client.get_experiment_by_name("kv").experiment_id], "tags.`ppl_audit.kind` = 'variant'")}
    assert runs["kv8"].data.params["kv_cache"] == "int8 g32 (llama.cpp q8_0)"
    assert runs["kv8"].data.metrics["kv_bytes_per_token"] == 272
    assert runs["kv8"].data.metrics["kv_saving_pct"] == pytest.approx(rows["kv8"]["kv_saving_pct"])
    # the size chart gains the cache's axis: bytes per token, each variant at its cache's
    from tasks.core.places import synced_dir
    from tasks.record.plots import KV_SIZE, size_quality_chart
    from tasks.record.spool import read_record

    record = read_record(max(synced_dir().glob("*-kv-*"), key=lambda folder: folder.stat().st_mtime))
    axes = size_quality_chart(record).axes
    assert len(axes) == 6 and axes[2].get_xlabel() == KV_SIZE[1]
    at = {text.get_text(): text.xy[0] for text in axes[2].texts}
    assert at == {"kv8": 272, "kv4": 144, "int8-kv-fp8": 2 * 2 * 2 * 32}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PPL_AUDIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("kv, says", [
    ({"dtype": "int3"}, "variants.0.kv_cache.dtype: Input should be 'int8', 'int4', 'fp8_e4m3', 'fp8_e5m2'"),
    ({"dtype": "int8", "group_size": 24}, "kv: kv_cache.group_size 24 does not divide the model's head dimension 32"),
    ({"dtype": "fp8_e4m3", "group_size": 16}, "group_size applies to int8 and int4 caches, not fp8_e4m3"),
])
def test_a_bad_cache_setting_is_one_line_and_exit_2_before_anything_loads(capsys, tmp_path, trained_model_dir,
                                                                          corpus_path, kv, says):
    config = write_config(tmp_path / "bad.yaml", trained_model_dir, corpus_path, [{"name": "kv", "kv_cache": kv}])
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "Traceback" not in err, err


def test_a_diagnosis_of_a_cached_variant_is_refused_with_what_to_do(tmp_path, trained_model_dir, corpus_path):
    from tasks.audit.diagnose import narrowed
    from tasks.config import load_audit_config
    from tasks.core.errors import InputError

    config = write_config(tmp_path / "kv.yaml", trained_model_dir, corpus_path, [{"name": "kv8", "kv_cache": {"dtype": "int8"}}])
    with pytest.raises(InputError, match="scored with a quantized key/value cache, which a diagnosis of its layers"):
        narrowed(load_audit_config(str(config), []), "kv8")


def test_the_baseline_s_own_cache_is_refused_with_what_to_do(capsys, tmp_path, trained_model_dir, corpus_path):
    config = write_config(tmp_path / "bad.yaml", trained_model_dir, corpus_path, [{"name": "int8", "method": "torchao-int8"}])
    text = config.read_text().replace(f"path: {trained_model_dir}", f"path: {trained_model_dir}\n  kv_cache: {{dtype: int8}}", 1)
    config.write_text(text)
    assert main(["run", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert "kv_cache is a variant's: to measure the cache alone, add a variant of the baseline's own weights" in err
