"""docs/results.md and the README's headline are generated from bench/results
by scripts/render_results.py: stale output fails here, new or unknown result
files are listed instead of dropped, and a changed figure changes the output."""

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "render_results.py"


@pytest.fixture(scope="module")
def renderer():
    spec = importlib.util.spec_from_file_location("render_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_committed_results_doc_and_readme_headline_are_current(renderer):
    for rel, text in renderer.render(ROOT).items():
        current = (ROOT / rel).read_text()
        assert current == text, (
            f"{rel} is stale: bench/results changed without re-rendering; run "
            f"`python scripts/render_results.py` and commit the result"
        )


def test_check_mode_names_the_stale_file_and_writes_nothing(tmp_path):
    copy = tmp_path / "repo"
    (copy / "scripts").mkdir(parents=True)
    for script in ["render_results.py", *(p.name for p in (ROOT / "scripts").glob("results_*.py"))]:
        shutil.copy(ROOT / "scripts" / script, copy / "scripts")
    shutil.copytree(ROOT / "bench" / "results", copy / "bench" / "results")
    (copy / "docs").mkdir()
    shutil.copy(ROOT / "README.md", copy / "README.md")
    (copy / "docs" / "results.md").write_text("old\n")
    run = subprocess.run([sys.executable, str(copy / "scripts" / "render_results.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "stale: docs/results.md" in run.stderr
    assert (copy / "docs" / "results.md").read_text() == "old\n"
    assert subprocess.run([sys.executable, str(copy / "scripts" / "render_results.py")],
                          capture_output=True, text=True, timeout=120).returncode == 0
    assert subprocess.run([sys.executable, str(copy / "scripts" / "render_results.py"), "--check"],
                          capture_output=True, text=True, timeout=120).returncode == 0


def _results_copy(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "bench" / "results", root / "bench" / "results")
    return root


def test_a_changed_figure_changes_the_rendered_doc(renderer, tmp_path):
    root = _results_copy(tmp_path)
    path = root / "bench" / "results" / "sim0523_cp4_upstream.json"
    data = json.loads(path.read_text())
    data["write_failures"] = 12345
    data["corrupted_pages"] = 7
    path.write_text(json.dumps(data))
    doc = renderer.render(root)["docs/results.md"]
    assert "| CP 4, 16 / 24 | upstream | 12,345 (382) |" in doc
    assert "7 corrupted" in doc and doc != renderer.render(ROOT)["docs/results.md"]


def test_unknown_and_future_files_are_listed_not_dropped(renderer, tmp_path):
    root = _results_copy(tmp_path)
    results = root / "bench" / "results"
    (results / "later").mkdir()
    later_run = json.loads((results / "sim_cp4.json").read_text())
    later_run["workload"] = "trace: chat-a.jsonl"
    later_run["prompt_tokens"] = 424242
    (results / "later" / "chat_a.json").write_text(json.dumps(later_run))
    (results / "l3_bench.json").write_text(json.dumps({"backend": "file", "put_gbps": 1.5, "pages": 64}))
    (results / "odd_list.json").write_text("[1, 2, 3]")
    (results / "broken.json").write_text("{not json")
    (results / "notes.txt").write_text("hello")
    doc = renderer.render(root)["docs/results.md"]
    assert "## Other simulator runs" in doc and "later/chat_a.json" in doc and "424,242" in doc
    assert "## Other files" in doc
    assert "`l3_bench.json`" in doc and "`backend` = file" in doc and "`put_gbps` = 1.50" in doc
    assert "`odd_list.json`" in doc and "JSON list of 3" in doc
    assert "`broken.json`" in doc and "not readable: JSONDecodeError" in doc
    assert "`notes.txt`" in doc
    # every file under bench/results is named somewhere in the doc
    for path in results.rglob("*"):
        if path.is_file():
            assert path.relative_to(results).as_posix() in doc, path


def test_no_results_at_all_still_renders(renderer, tmp_path):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    doc = renderer.render(tmp_path)["docs/results.md"]
    assert doc.startswith("# Results") and "**not measured yet**" in doc


def test_the_readme_what_you_get_block_is_the_committed_comparison(renderer, tmp_path):
    root = _results_copy(tmp_path)
    (root / "README.md").write_text((ROOT / "README.md").read_text())
    path = root / "bench" / "results" / "sim0523_compare_upstream.json"
    data = json.loads(path.read_text())
    block = renderer.render(ROOT)["README.md"].split(renderer.GET_START)[1].split(renderer.GET_END)[0]
    assert f"**{data['paths']['library']['hit_ratio']:.3f}**" in block and "refused by SGLang" in block
    data["paths"]["library"]["hit_ratio"] = 0.123456
    path.write_text(json.dumps(data))
    changed = renderer.render(root)["README.md"]
    assert "**0.123**" in changed.split(renderer.GET_START)[1].split(renderer.GET_END)[0]
    assert "library with L3" not in changed  # the trace row is the block's now, not the headline's
