"""What a reviewer reads first: the ΔPPL chart and the HTML report of a real audit, as MLflow holds them."""

from __future__ import annotations

import base64
import html
import io
import json
import re
from pathlib import Path

import pytest
from helpers import assert_reads_back, typed, write_config
from matplotlib.colors import to_rgb
from mlflow import MlflowClient

from flows.audit import audit, result_of

pytestmark = pytest.mark.usefixtures("prefect_harness")

HOSTILE = "gone<b>x</b>&amp;|*y*"  # a folder name that markup would swallow if the report did not escape it


@pytest.fixture(scope="module")
def audited(tmp_path_factory, trained_model_dir, noisy_model_dir, corpus_path, prefect_harness):
    """One audit with a verdict of each kind: int8 passes (limit 5%), noisy fails its own limit (1%),
    missing errs (its folder, named with markup, does not exist). Returns (client, parent run, record, the record's
    folder, the audit's result)."""
    folder = tmp_path_factory.mktemp("report")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPL_AUDIT_HOME", str(folder / "home"))
        uri = f"sqlite:///{folder / 'mlflow.db'}"
        config = write_config(folder / "report.yaml", trained_model_dir, corpus_path,
                              [{"name": "int8", "method": "torchao-int8"},
                               {"name": "noisy", "path": str(noisy_model_dir)},
                               {"name": "missing", "path": str(folder / HOSTILE)}],
                              name="reported", tracking={"uri": uri, "experiment": "tests"},
                              thresholds={"max_ppl_increase_pct": 5,
                                          "per_variant": {"noisy": {"max_ppl_increase_pct": 1}}})
        summary = result_of(audit(config=str(config), return_state=True))
        [record_folder] = (folder / "home" / "synced").iterdir()
    client = MlflowClient(uri)
    record = json.loads((record_folder / "record.json").read_text())
    assert {v.name: v.status for v in summary.verdicts} == {"int8": "pass", "noisy": "fail", "missing": "error"}
    return client, client.get_run(summary.mlflow_run_id), record, record_folder, summary


def test_the_record_reads_back_as_the_result_every_view_read(audited):
    """``from_record`` gives back what the audit's console and ``--json`` printed, from the record alone: a pass, a
    fail, an error (#68)."""
    *_, record, _, result = audited
    assert_reads_back(result, record)


def report_of(client: MlflowClient, run, tmp_path: Path) -> str:
    return Path(client.download_artifacts(run.info.run_id, "report.html", str(tmp_path))).read_text()


def test_the_report_stands_alone_and_shows_every_variant_with_its_verdict(audited, tmp_path):
    from PIL import Image

    client, parent, record, _, _ = audited
    report = report_of(client, parent, tmp_path)
    # nothing fetched from elsewhere: a mailed copy reads the same offline
    assert not re.search(r"""((src|href)\s*=\s*["']?|url\(\s*["']?)\s*(https?:|//)|@import""", report, re.IGNORECASE)
    assert "<script" not in report.lower() and "<link" not in report.lower()
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', report)
    assert [name for name, _ in images] == ["delta_ppl_pct.png", "ppl_by_model.png", "size_quality.png",
                                            "token_kld_histogram.png", "window_delta_nll.png"]  # the ΔPPL chart first
    assert all(Image.open(io.BytesIO(base64.b64decode(data))).size[0] >= 1200 for _, data in images)
    assert re.search(r'<h1>Audit reported <span class="badge fail">FAIL</span></h1>', report)
    children = {r.data.tags["ppl_audit.variant"]: r for r in client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}
    for name, verdict in (("int8", "PASS"), ("noisy", "FAIL"), ("missing", "ERROR")):
        row = re.search(rf'<tr class="model"><th>{name}</th>.*?</tr>', report).group(0)
        assert f'<span class="badge {verdict.lower()}">{verdict}</span>' in row
        if name != "missing":
            metrics = children[name].data.metrics
            assert (f"{metrics['delta_ppl_pct']:+z.2f} [{metrics['delta_ppl_pct_low']:+z.2f}, "
                    f"{metrics['delta_ppl_pct_high']:+z.2f}]") in row
    assert "≤ 1</td>" in re.search(r'<tr class="model"><th>noisy</th>.*?</tr>', report).group(0)  # its own limit, not the 5%
    # what each costs: the float noisy model (32 bits a weight) is larger than int8 and worse beyond noise
    assert '<td class="n">32.00</td></tr>' in re.search(r'<tr class="model"><th>noisy</th>.*?</tr>', report).group(0)
    assert re.search(r'<tr class="model"><th>noisy</th>.*?</tr><tr><td class="reason" colspan="9">[^<]*; dominated by '
                     r'int8</td>', report)
    # settings and lineage: what was scored, how, and from what
    assert record["corpus"]["digest"] in report and record["audit_id"] in report
    assert record["environment"]["versions"]["torch"] in report
    # the hostile folder name is shown as text, in the reason and in the lineage, never as markup
    assert "<b>x</b>" not in report and report.count(html.escape(HOSTILE, quote=False)) >= 2


def test_the_run_description_shows_each_verdict_before_show_more(audited):
    from markdown_it import MarkdownIt

    _, parent, _, _, _ = audited
    note = parent.data.tags["mlflow.note.content"]
    page = MarkdownIt("commonmark").enable("table").render(note)
    rows = re.findall(r"<tr>(.*?)</tr>", page, re.DOTALL)
    cells = [re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row, re.DOTALL) for row in rows]
    # the header and four rows are what MLflow 3.17 shows unfolded: failures first, the baseline last
    assert [c[:2] for c in cells] == [["model", "verdict"], ["missing", "ERROR"], ["noisy", "FAIL, dominated by int8"],
                                      ["int8", "PASS"], ["baseline", "BASELINE"]]
    assert all(len(c) == 8 for c in cells) and [c[-1] for c in cells] == ["bpw", "—", "32.00", cells[3][-1], "32.00"]
    # the reason (with the hostile folder name) is the audit.reason tag's, not markup here
    assert "<b>" not in page and "<em>" not in page and "missing: " in parent.data.tags["audit.reason"]


def test_the_delta_chart_has_a_bar_per_scored_variant_in_its_verdict_colour_and_its_own_limit(audited):
    from matplotlib.collections import LineCollection
    from matplotlib.patches import Rectangle

    from tasks.record.plots import delta_ppl_chart, ppl_chart

    _, _, record, _, _ = audited
    rows = {v["name"]: v["row"] for v in record["variants"]}
    [axis] = delta_ppl_chart(record).axes
    bars = {round(bar.get_y() + bar.get_height() / 2): bar for bar in axis.patches if isinstance(bar, Rectangle)}
    names = [label.get_text() for label in axis.get_yticklabels()]
    assert names == ["int8", "noisy", "missing"]  # the config's order, top to bottom
    assert sorted(bars) == [0, 1]  # the missing variant has no bar
    for slot, name in enumerate(names[:2]):
        assert bars[slot].get_width() == pytest.approx(rows[name]["delta_ppl_pct"])
    red, green, _ = to_rgb(bars[0].get_facecolor())
    assert green > 1.5 * red  # int8 passed
    red, green, _ = to_rgb(bars[1].get_facecolor())
    assert red > 1.5 * green  # noisy failed
    # each variant's own gate limit: 5% for int8 and missing, 1% for noisy (its per_variant override)
    limits = {round(start[1]): start[0] for collection in axis.collections if isinstance(collection, LineCollection)
              for start, end in collection.get_segments() if start[0] == end[0]}  # upright: not a whisker
    assert limits == {0: 5, 1: 1, 2: 5}
    texts = [t.get_text() for t in axis.texts]
    for name in names[:2]:
        row = rows[name]
        assert any(t.startswith(f"{row['delta_ppl_pct']:+z.2f}% [{row['delta_ppl_pct_low']:+z.2f}, ") for t in texts)
    assert any(t.startswith("error: model folder not found") for t in texts)
    legend = [t.get_text() for t in axis.figure.legends[0].get_texts()]
    assert legend == ["pass", "fail", "error", "estimate, paired 95% interval", "gate limit (max ΔPPL %)"]
    [ppl_axis] = ppl_chart(record).axes
    assert ppl_axis.get_xlim()[0] == 0  # zero-based: bar lengths compare perplexities


def test_a_chart_of_one_figure_says_which_gate_failed(audited):
    """int8 held to a top-1 limit it misses beside a ΔPPL limit it meets: its slot on the ΔPPL chart said "fail,
    limit ≤ 5%", as if its ΔPPL broke the limit; it says its ΔPPL is within it and which gate failed, and every
    chart that names a verdict (the PPL chart's note, the legends of the per-token charts) names that gate."""
    import copy

    from tasks.config import Thresholds
    from tasks.record.plots import delta_ppl_chart, kld_histogram, ppl_chart
    from tasks.record.verdict import judge_row

    _, _, record, folder, _ = audited
    record = copy.deepcopy(record)
    record["config"]["thresholds"]["per_variant"]["int8"] = {"min_top1_agreement": 1.0}
    int8 = next(v for v in record["variants"] if v["name"] == "int8")
    verdict = judge_row(typed(int8["row"]), Thresholds.model_validate(record["config"]["thresholds"]))
    assert verdict.status == "fail" and verdict.reason.startswith("top-1 agreement")  # its ΔPPL passes
    int8["verdict"] = {"status": verdict.status, "reason": verdict.reason}
    [axis] = delta_ppl_chart(record).axes
    said = next(t.get_text() for t in axis.texts if t.get_text().startswith(f"{int8['row']['delta_ppl_pct']:+z.2f}%"))
    assert "fail, limit" not in said
    assert "fail: ΔPPL within the limit ≤ 5%; top-1 agreement " in said and "breaks the limit ≥ 1" in said
    [ppl_axis] = ppl_chart(record).axes
    assert any(t.get_text().endswith("fail: top-1 agreement") for t in ppl_axis.texts)
    legend = [t.get_text() for t in kld_histogram(record, folder).legends[0].get_texts()]
    assert "int8 (fail: top-1 agreement)" in legend and "noisy (fail: ΔPPL)" in legend


def children_of(client: MlflowClient, parent) -> dict:
    """The parent's nested runs by model name."""
    return {r.data.tags["ppl_audit.variant"]: r for r in client.search_runs(
        [parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}


def test_each_scored_variant_says_where_in_the_text_it_loses(audited, tmp_path):
    """In the record, the variant's run and the report: its ΔNLL and KL by group over the very tokens its gate
    judged, and its 20 tokens of largest KL shown in their context as text."""
    from tasks.record.plots import where_chart

    client, parent, record, _, _ = audited
    entries = {entry["name"]: entry for entry in record["variants"]}
    assert "where" not in entries["baseline"] and "where" not in entries["missing"]
    runs = children_of(client, parent)
    report = report_of(client, parent, tmp_path)
    section = report[report.index("<h2>Where in the text</h2>") : report.index("<h2>Settings</h2>")]
    for name in ("int8", "noisy"):
        where, row = entries[name]["where"], entries[name]["row"]
        assert where["tokens"] == row["n_tokens"] == sum(group["tokens"] for group in where["by_position"])
        assert where["all"]["delta_nll"] == pytest.approx(row["delta_nll"], rel=1e-9)
        assert where["all"]["kl"] == pytest.approx(row["kld_mean"], rel=1e-9)
        assert sum(group["tokens"] for group in where["by_confidence"]) == row["n_tokens"]
        assert sum(group["tokens"] for group in where["by_baseline"]) == row["n_tokens"]
        kls = [token["kl"] for token in where["top_kl"]]
        assert len(kls) == 20 and kls == sorted(kls, reverse=True) and kls[0] == pytest.approx(row["kld_max"])
        run_id = runs[name].info.run_id
        assert {"where.json", "where.png"} <= {a.path for a in client.list_artifacts(run_id)}
        assert json.loads(Path(client.download_artifacts(run_id, "where.json", str(tmp_path))).read_text()) == where
        delta_axis = where_chart(entries[name]).axes[0]  # ΔNLL by position, the first of four
        heights = [bar.get_height() for bar in delta_axis.patches]
        assert heights == pytest.approx([group["delta_nll"] for group in where["by_position"] if group["tokens"]])
        assert f"<h3>{name} <span" in section
        for token in where["top_kl"]:  # escaped, as every text from the record
            assert html.escape(token["context"].replace("\n", "⏎")) in section
            assert html.escape(repr(token["target_text"])) in section
    assert "where.json" not in {a.path for a in client.list_artifacts(runs["baseline"].info.run_id)}


def test_a_record_from_before_where_was_kept_still_replays(audited, tmp_path):
    """An older record has no ``where``: it is logged and reported as before, with no section and no artifact."""
    import shutil

    from tasks.record.tracking import replay

    client, _, _, folder, _ = audited
    older = shutil.copytree(folder, tmp_path / folder.name)
    record = json.loads((older / "record.json").read_text())
    assert any("where" in entry for entry in record["variants"])
    for entry in record["variants"]:
        entry.pop("where", None)
    (older / "record.json").write_text(json.dumps(record))
    parent = client.get_run(replay(older, client.tracking_uri, "older records"))
    assert "Where in the text" not in report_of(client, parent, tmp_path)
    for run in children_of(client, parent).values():
        assert not {"where.json", "where.png"} & {a.path for a in client.list_artifacts(run.info.run_id)}


def test_the_size_chart_puts_each_costed_variant_at_its_bits_hollow_where_dominated(audited):
    from tasks.record.plots import COLOURS, size_quality_chart

    _, _, record, _, _ = audited
    rows = {v["name"]: v["row"] for v in record["variants"]}
    panels = [(key, size) for key in ("delta_ppl_pct", "kld_mean") for size in ("bits_per_weight", "weight_mib")]
    axes = size_quality_chart(record).axes
    assert len(axes) == len(panels)
    for axis, (key, size) in zip(axes, panels):
        assert {t.get_text() for t in axis.texts} == {"int8", "noisy"}  # missing was not scored
        points = {(round(line.get_xdata()[0], 6), round(line.get_ydata()[0], 6)): line for line in axis.lines
                  if line.get_marker() == "o"}
        for name, face in (("int8", COLOURS["pass"]), ("noisy", "white")):  # noisy is dominated by int8
            point = points[(round(rows[name][size], 6), round(rows[name][key], 6))]
            assert to_rgb(point.get_markerfacecolor()) == to_rgb(face)


def test_a_per_model_figure_is_in_every_view_and_equals_its_count_from_the_stored_tokens(audited, tmp_path):
    """The confident-flip rate (#70's first tail figure, declared once in ``figures.SHOWN``): the record's figure is an
    independent count over the variant's stored per-token arrays, and the console's ``--stats full``, ``--json``,
    MLflow's metrics, report.html and the card each give it."""
    import pyarrow.parquet as pq

    from tasks.record.answer import answer_json, answer_text
    from tasks.record.card import render

    client, parent, record, folder, result = audited
    noisy = next(entry for entry in record["variants"] if entry["name"] == "noisy")
    tokens = pq.read_table(folder / noisy["arrays"]).to_pandas()
    sure, differ = tokens["base_top_p"] >= 0.9, ~tokens["top1"]
    # not a count of nothing: the baseline is sure of some tokens and the variant differs on others (here none is
    # both: the noise moves the tokens the baseline is unsure of; tests/test_paired.py counts flips that occur)
    assert sure.sum() > 0 and differ.sum() > 0
    rate = noisy["row"]["confident_flip_rate"]
    assert rate == int((sure & differ).sum()) / len(tokens)
    shown = f"{100 * rate:.2f}% [{100 * noisy['row']['confident_flip_rate_low']:.2f}, " \
            f"{100 * noisy['row']['confident_flip_rate_high']:.2f}]"
    assert re.search(rf"\nconfident flips +: {re.escape(shown)} \(± ", answer_text(result, stats="full"))
    assert json.loads(answer_json(result))["models"][2]["confident_flip_rate"] == rate
    [child] = [run for run in client.search_runs([parent.info.experiment_id], "tags.`ppl_audit.variant` = 'noisy'")]
    assert child.data.metrics["confident_flip_rate"] == rate and "confident_flip_rate_high" in child.data.metrics
    assert f"<td>{html.escape(shown)}</td>" in report_of(client, parent, tmp_path)
    assert f"| noisy | {shown} |" in render(record, "md", "runs:/x")


RECORDS = Path(__file__).parent / "records"  # the demo's stored records (tests/test_records.py)


def _where_group(group) -> dict:
    """A group of ``where`` as read, under the record's names for its fields."""
    return {"tokens": group.tokens, "low": group.low, "high": group.high, "baseline": group.baseline,
            "delta_nll": group.delta_nll.value, "delta_nll_low": group.delta_nll.low,
            "delta_nll_high": group.delta_nll.high, "kl": group.kl.value, "kl_low": group.kl.low,
            "kl_high": group.kl.high}


def _assert_where_reads(where, said: dict) -> None:
    """``where`` (a ``WhereSaid``) holds what the record's ``said`` does, field for field."""
    import dataclasses

    assert where.interval == said["interval"] and (where.by_confidence is None) == ("by_confidence" not in said)
    read = [where.all, *where.by_position, *(where.by_confidence or ()), *where.by_baseline]
    stored = [said["all"], *said["by_position"], *said.get("by_confidence", []), *said.get("by_baseline", [])]
    assert len(read) == len(stored)
    for group, row in zip(read, stored):
        found = _where_group(group)
        assert {key: found[key] for key in row} == row  # and what the record lacks reads as None
        assert all(value is None for key, value in found.items() if key not in row)
    tokens = [dataclasses.asdict(token) for token in where.top_kl]
    assert tokens == [{key: token[key] for key in tokens[0]} for token in said["top_kl"]] and len(tokens) == 20


def _assert_model_reads(model, entry: dict) -> None:
    """``model`` (a ``ModelSaid``) holds what the record's ``entry`` does, field for field."""
    import dataclasses

    assert (model.name, model.role, model.status, model.reason, model.method, model.domain, model.arrays) == (
        entry["name"], entry["role"], entry["status"], entry["reason"], entry["spec"]["method"], entry.get("domain"),
        entry.get("arrays"))
    assert model.row.as_record() == entry["row"]
    assert (model.verdict.as_record() if model.verdict else None) == entry["verdict"]
    assert model.diagnosis is None and model.problem is None  # the demo diagnosed none
    assert (model.reference.as_record() if model.reference else None) == (entry.get("reference") or None)
    facts, spec, manifest = entry["facts"], entry["spec"], entry["manifest"] or {}
    lineage = model.lineage
    assert (lineage.method, lineage.path, lineage.loaded_from, lineage.dtype, lineage.device, lineage.backend,
            lineage.size_on_disk_bytes, lineage.bits_per_weight, lineage.model_bits_per_weight) == (
        facts["method"], spec["path"], facts["source"], facts["dtype"], facts["device"], facts["backend"],
        facts["size_on_disk_bytes"], facts["bits_per_weight"], facts["model_bits_per_weight"])
    assert (lineage.bits, lineage.group_size, lineage.sym, lineage.source_model_digest) == (
        spec["bits"] or manifest.get("bits"), spec["group_size"] or manifest.get("group_size"),
        manifest.get("sym") if spec["sym"] is None else spec["sym"], manifest.get("source_model_digest"))
    calibration = manifest.get("calibration")
    assert (dataclasses.asdict(lineage.calibration) if lineage.calibration else None) == (
        {key: calibration[key] for key in ("samples", "seq_len", "seed", "digest")} if calibration else None)
    found = facts["quantization"]
    gguf = {key: found[key] for key in ("file_type", "tensor_types", "bits_per_weight")} if "file_type" in found else None
    assert (dataclasses.asdict(lineage.format) if lineage.format else None) == gguf
    if entry.get("where"):
        _assert_where_reads(model.where, entry["where"])
    else:
        assert model.where is None


@pytest.mark.parametrize("name", ["demo-2026-11-28", "demo-2026-11-29"])
def test_a_stored_record_reads_field_for_field_as_the_report_and_charts_read_it(name):
    """``RecordSaid.of_record`` over the demo's records (schema 1 and 2), each domain's too: every field the report and
    the charts read is the record's own, from where the record holds it (#68)."""
    import dataclasses
    import lzma

    from tasks.config import Thresholds
    from tasks.record.domain_view_said import domain_view
    from tasks.record.entry_said import RecordSaid

    record = json.loads(lzma.open(RECORDS / f"{name}.record.json.xz").read())
    said = RecordSaid.of_record(record)
    assert list(said.domains) == list(record["domains"]) and len(record["domains"]) > 1
    pairs = [(said, record), *((said.domains[domain], domain_view(record, domain)) for domain in record["domains"])]
    for view, stored in pairs:
        assert (view.result.name, view.audit_id, view.started, view.created, view.config_path, view.config_text,
                view.domain) == (stored["name"], stored["audit_id"], stored["started"], stored["created"],
                                 stored["config_path"], stored["config_text"], stored.get("domain"))
        assert view.result.verdict.as_record() == stored["verdict"]
        assert dataclasses.asdict(view.environment) == stored["environment"]
        corpus = dataclasses.asdict(view.corpus)
        said_tokenizer = stored["corpus"].get("tokenizer", "transformers")  # records of before #54 did not say
        assert corpus == {key: stored["corpus"].get(key) for key in corpus} | {"tokenizer": said_tokenizer} \
            and corpus["digest"]
        assert view.evaluation.window == stored["config"]["evaluation"]["window"]
        assert view.thresholds == Thresholds.model_validate(stored["config"]["thresholds"])
        assert view.population == stored["population"]
        assert [(floor.row.as_record(), floor.dtype) for floor in view.floor] == [
            (floor["row"], floor["dtype"]) for floor in stored["floor"]]
        assert len(view.models) == len(stored["variants"])
        for model, entry in zip(view.models, stored["variants"]):
            _assert_model_reads(model, entry)
    assert any(view.floor for view in said.domains.values())  # the floors were read where the record holds them


def test_a_diagnosis_that_failed_reads_as_its_problem():
    import lzma

    from tasks.record.entry_said import ModelSaid

    record = json.loads(lzma.open(RECORDS / "demo-2026-11-29.record.json.xz").read())
    entry = record["variants"][1] | {"diagnosis": {"variant": record["variants"][1]["name"], "problem": "no <i>layers</i>"}}
    model = ModelSaid.alone(entry)
    assert (model.problem, model.diagnosis, model.row.as_record(), model.verdict.as_record()) == (
        "no <i>layers</i>", None, entry["row"], entry["verdict"])
