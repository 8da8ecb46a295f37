"""The figures README.md and docs/ quote that a test can recompute, recomputed: numbers that drift as the code
changes stay true, or a test names the one that drifted and what it now is.

- the quick tier's test count (README, Tests), from this very pytest session's items when it collected the whole
  suite (the default run and `-m quick`: free, nothing is run twice);
- the 4K recipes' memory figures (README's sentence on `step35 plan`, docs/plan.md's table rows and peaks), from
  `step35 plan --json` run here, the other devices' columns by the rule docs/plan.md states (peak + 5 % +
  the device's runtime reserve, step35/plan/devices.py);
- the commands the README gives for the tiny Step-3.7 and FP8 folders and the Muon recipe: options that exist.

The "answers and stops" claim on the fine-tuned model's chat replies is checked where the README's jobs run
(tests/test_readme.py: the quality gate's missing-EOS rate)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.runner import ROOT, run_plan

README = (ROOT / "README.md").read_text()
PLAN_DOC = (ROOT / "docs" / "plan.md").read_text()
GIB = 1024**3
QUICK_TOLERANCE = 0.10  # the README's count may lag the suite by this fraction before the test asks for a new one


# ------------------------------------------------------------------------------ the quick tier's count
def readme_quick_count() -> int:
    found = re.findall(r"the quick tier[^.]*?\n?[^.]*?([\d,]+) tests", README.split("## Tests", 1)[1])
    assert len(found) == 1, found
    return int(found[0].replace(",", ""))


def collected_whole_suite(config) -> bool:
    """Whether this session collected every test file with no selection beyond a tier: no file or node arguments,
    no -k, --deselect or --lf, and -m either the default ("not slow") or the quick tier."""
    args = [Path(a).resolve() for a in config.args]
    return (
        args == [ROOT / "tests"]
        and not config.option.keyword
        and not config.option.deselect
        and not getattr(config.option, "lf", False)
        and config.option.markexpr in ("not slow", "quick")
    )


def test_the_readme_states_the_quick_tier_count(request):
    """Before: 591, when the quick tier held 975 tests. The README's count is within 10 % of the tests this
    session marked quick (tests/conftest.py: every test without slow, multiprocess or heavy)."""
    if not collected_whole_suite(request.config):
        pytest.skip("counts the quick tier only in a run that collected the whole suite (python -m pytest)")
    count = sum(1 for item in request.session.items if item.get_closest_marker("quick"))
    stated = readme_quick_count()
    assert abs(stated - count) <= QUICK_TOLERANCE * count, (
        f"README.md (Tests) says the quick tier has {stated} tests; it has {count}: write {count}"
    )


# ------------------------------------------------------------------------------ step35 plan's figures
def plan_json(capsys, recipe: str) -> dict:
    code, out, err = run_plan(capsys, "--config", f"configs/flash-196b-4k-{recipe}.yaml", "--json")
    assert code == 0, err[-3000:]
    return json.loads(out)


def required_on(plan: dict, device: str) -> tuple[float, float]:
    """(required GiB, free % of the device) of `plan`'s peak on `device` by docs/plan.md's rule: peak + the
    allocator margin (5 % of the peak) + the device's runtime reserve (step35/plan/devices.py)."""
    from step35.plan.devices import DEVICES

    spec = DEVICES[device]
    required = (plan["verdict"]["peak"] + plan["verdict"]["allocator_margin"]) / GIB + spec.runtime_reserve_gib
    return required, 100 * (spec.memory_gib - required) / spec.memory_gib


@pytest.mark.heavy  # two 196B plans (the model sharded on the meta device for 192 and 64 simulated ranks)
@pytest.mark.timeout(600)
def test_the_plan_figures_in_the_docs_are_step35_plans(capsys):
    """Before: README and docs/plan.md said 59.4 GiB for the GPU recipe (28.0 for the NPU one), from before
    issue 30; `step35 plan` prints 59.09 (27.73). Each figure is recomputed: the README's sentence (required on
    the recipe's device, to the hundredth, and its free %), docs/plan.md's shipped rows (activations, peak,
    required and verdict on 64, 80 and 141 GiB devices, MFU bound) and its peak sentences."""
    sentence = re.search(
        r"the NPU recipe: ([\d.]+) of (\d+) GiB, (\d+) % free; the GPU recipe: ([\d.]+) of (\d+) GiB, (\d+) %", README
    )
    assert sentence, "README.md: the sentence on the recipes' margins is gone"
    stated = {"npu": sentence.group(1, 2, 3), "gpu": sentence.group(4, 5, 6)}
    for recipe, device in (("npu", "910b"), ("gpu", "h100")):
        plan = plan_json(capsys, recipe)
        verdict = plan["verdict"]
        assert stated[recipe] == (
            f"{verdict['required'] / GIB:.2f}",
            f"{plan['device']['memory_gib']:g}",
            f"{verdict['margin_pct']:.0f}",
        ), recipe
        assert required_on(plan, device) == pytest.approx((verdict["required"] / GIB, verdict["margin_pct"]))
        cells = [f"{plan['activations']['total'] / GIB:.2f}", f"{verdict['peak'] / GIB:.1f}"]
        for other in ("910b", "h100", "h200"):
            required, free = required_on(plan, other)
            cells.append(f"{required:.1f}, " + (f"FITS {free:.0f} %" if free >= 0 else "DOES NOT FIT"))
        cells.append(f"{100 * plan['speed']['mfu_bound']:.0f} %")
        row = f"| {recipe} | full (as shipped) | " + " | ".join(cells) + " |"
        assert row in PLAN_DOC.splitlines(), f"docs/plan.md: the {recipe} row should read\n{row}"
        assert f"peak {verdict['peak'] / GIB:.1f} GiB in block backward." in PLAN_DOC, recipe
        if recipe == "gpu":  # the LoRA recipe's comparison table quotes the GPU recipe beside it
            pair = f"| {verdict['peak'] / GIB:.1f} / {verdict['required'] / GIB:.1f} GiB |"
            assert any(line.startswith("| peak / required |") and line.endswith(pair) for line in PLAN_DOC.splitlines())


# ------------------------------------------------------------------------------ commands the README gives
def test_the_readme_tiny_folder_commands_name_the_scripts_kinds():
    """Each `scripts/make_tiny_folder.py` line of the README names a --kind the script has, and the fit after it
    starts from the folder it made (tests/test_tiny_folders.py runs the script itself)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_tiny_folder", ROOT / "scripts" / "make_tiny_folder.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    lines = re.findall(r"^python scripts/make_tiny_folder\.py (.*)$", README, flags=re.M)
    assert lines
    for line in lines:
        kinds = re.findall(r"--kind ([\w-]+)", line)
        assert kinds and set(kinds) <= set(script.KINDS), line
        out = re.search(r"--out (\S+)", line).group(1)
        assert re.search(rf"^step35 fit .*--model\.checkpoint {re.escape(out)}\b", README, flags=re.M), out


def test_the_readme_muon_recipe_is_a_config_step35_fit_accepts(capfd, monkeypatch, builtin_cache):
    """The README's Muon command, as written (one inline command over two lines), resolves to Muon with the
    stepfun preset at the main job's lr (checked by --print_config: no training)."""
    import shlex

    from tests.runner import cli

    found = re.search(r"`(step35 fit --config configs/tiny\.yaml --model\.optimizer muon[^`]*)`", README)
    assert found, "README.md: the Muon recipe's command is gone"
    words = shlex.split(found.group(1).replace("\n", " "))
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("STEP35_CACHE", str(builtin_cache))
    code, out, err = cli(capfd, *words[1:], "--print_config")
    assert code == 0, err[-3000:]
    assert "optimizer: muon" in out and "preset: stepfun" in out and "lr: 0.003" in out, out[-3000:]
