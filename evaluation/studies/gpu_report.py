"""Write ``README.md`` of a GPU check (``scripts/gpu_check.sh``, issue 19) from the files its stages left.

Reads, in the check's output folder (each one optional: a missing stage is reported as missing):

- ``stages.csv``: ``stage, rc, seconds`` per stage (written by ``gpu_check.sh``);
- ``install.txt``, ``env.txt``: what the install stage decided and did, ``nvidia-smi`` and versions;
- ``kernel_tests.xml``: pytest's JUnit report of ``tests/test_kernels.py``;
- ``kernels/*.csv`` (or ``kernels/dry_run/*.csv``): :mod:`evaluation.studies.bench_kernels`;
- ``end_to_end/agreement_summary.csv``, ``end_to_end/timing.csv``, ``end_to_end/meta.json``:
  :mod:`evaluation.studies.gpu_end_to_end`.

and writes ``README.md`` beside them: device, versions, the command, how to run it, one table per stage,
and the issue's goals checked against the numbers (:data:`GOALS`). Needs only the standard library (and
:mod:`evaluation.tables`, which needs no more).

Usage (``python -m evaluation.studies.gpu_report`` is the same)::

    python scripts/gpu_report.py results/gpu --mode gpu --command "bash scripts/gpu_check.sh"
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from evaluation.atomic import write_atomic
from evaluation.cli import ArgumentParser
from evaluation.tables import fmt, markdown_table, num, read_rows

#: The issue's goals (issue 19): kernel tests, kernel speed and bandwidth at the largest T, agreement.
GOALS = {"speedup": 5.0, "bandwidth_fraction": 0.70, "jaccard": 0.99}

#: How a session with a GPU lent runs the check (the device tool's ``run`` call), after
#: ``bash scripts/gpu_check.sh --prepare`` in the checkout that the call sends.
RUN_CALL = 'run(command="bash scripts/gpu_check.sh", carry=["wheels"], timeout_s=540)'

DTYPES = ("float32", "bfloat16", "float16")


# ---------------------------------------------------------------------------------------------- kernel tests
def junit_cases(path: Path) -> list[dict]:
    """Test cases of a JUnit XML file: ``name``, ``test`` (function), ``dtype`` (or ``-``), ``outcome``
    (passed / failed / error / skipped) and ``message``."""
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (
                    (el.get("message") or el.text or "").strip().splitlines()[0][:200]
                    if (el.get("message") or el.text)
                    else ""
                )
                break
        dtype = next((d for d in DTYPES if re.search(rf"\b{d}\b", name)), "-")
        cases.append({"name": name, "test": name.split("[")[0], "dtype": dtype, "outcome": outcome, "message": message})
    return cases


def kernel_test_section(out: Path) -> tuple[list[str], bool | None]:
    """README lines for the compiled kernel tests and whether every test passed (None: no report)."""
    cases = junit_cases(out / "kernel_tests.xml")
    lines = ["## Kernel tests (`tests/test_kernels.py`)", ""]
    if not cases:
        return lines + ["No JUnit report (`kernel_tests.xml`): the stage did not run or did not finish.", ""], None
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    lines.append(f"{len(cases)} tests: " + ", ".join(f"{v} {k}" for k, v in counts.items()) + ".")
    lines.append("")
    tests = sorted({c["test"] for c in cases}, key=[c["test"] for c in cases].index)
    rows = []
    for t in tests:
        row = [f"`{t}`"]
        for d in (*DTYPES, "-"):
            sel = [c for c in cases if c["test"] == t and c["dtype"] == d]
            row.append("" if not sel else f"{sum(c['outcome'] == 'passed' for c in sel)}/{len(sel)}")
        rows.append(row)
    lines += markdown_table(["test (passed/run)", *DTYPES, "no dtype"], rows)
    bad = [c for c in cases if c["outcome"] != "passed"]
    if bad:
        lines += ["", "Not passed:", ""] + [f"- `{c['name']}`: {c['outcome']}: {c['message']}" for c in bad]
    lines.append("")
    return lines, not bad


# ---------------------------------------------------------------------------------------------- benchmark
def bench_rows(out: Path) -> list[dict]:
    """Rows of every ``kernels/*.csv`` (GPU run) or ``kernels/dry_run/*.csv`` (dry run)."""
    rows = []
    for sub in ("kernels", "kernels/dry_run"):
        for path in sorted((out / sub).glob("*.csv")):
            rows += read_rows(path)
    return rows


def bench_section(out: Path) -> tuple[list[str], list[str]]:
    """README lines for the kernel benchmark and the goal lines (speedup, bandwidth at the largest T)."""
    rows = bench_rows(out)
    lines = ["## Kernel benchmark (`scripts/bench_kernels.py`)", ""]
    if not rows:
        return lines + ["No benchmark CSVs: the stage did not run or did not finish.", ""], []
    first = rows[0]
    lines += [
        f"Device `{first.get('device', '')}`; peak bandwidth {first.get('peak_GBps', '-')} GB/s "
        f"({first.get('peak_source', '-')}); measured device-to-device copy {first.get('copy_GBps', '-')} GB/s. "
        f"Status: {first.get('status', '')}. Times are medians of CUDA events after a warm-up call; "
        "`x` = reference time / Triton time; bandwidth = ideal bytes / Triton time.",
        "",
    ]
    body = []
    for r in rows:
        g = r.get  # columns other than the goals' may be missing in an older CSV
        body.append(
            [
                r["kernel"],
                r["T"],
                g("dtype", "-"),
                fmt(g("reference_ms"), ".4g"),
                fmt(g("triton_ms"), ".4g"),
                fmt(r["speedup_ref_over_triton"], ".3g"),
                fmt(g("triton_GBps"), ".4g"),
                fmt(r["bandwidth_fraction"], ".1%"),
                fmt(g("fraction_of_copy"), ".1%"),
                g("bound", "-"),
                fmt(g("reference_peak_extra_MB"), ".4g"),
                fmt(g("triton_peak_extra_MB"), ".4g"),
                fmt(g("max_abs_diff"), ".2g"),
                g("note", ""),
            ]
        )
    lines += markdown_table(
        [
            "kernel",
            "T",
            "dtype",
            "reference ms",
            "Triton ms",
            "x",
            "Triton GB/s",
            "of peak",
            "of copy",
            "bound",
            "ref peak MB",
            "Triton peak MB",
            "max diff",
            "note",
        ],
        body,
    )
    lines.append("")
    goals = []
    t_max = max(int(num(r["T"])) for r in rows)
    for r in (r for r in rows if int(num(r["T"])) == t_max):
        sp, bw = num(r["speedup_ref_over_triton"]), num(r["bandwidth_fraction"])
        ok_sp = sp >= GOALS["speedup"]
        text = f"`{r['kernel']}` at T={t_max}: x{fmt(sp)} ({'meets' if ok_sp else 'misses'} x{GOALS['speedup']:g})"
        if r.get("bound") == "memory":
            ok_bw = bw >= GOALS["bandwidth_fraction"]
            text += (
                f", {fmt(bw, '.1%')} of peak bandwidth ({'meets' if ok_bw else 'misses'} "
                f"{GOALS['bandwidth_fraction']:.0%}, memory-bound)"
            )
        else:
            text += f", {fmt(bw, '.1%')} of peak bandwidth (compute-bound: the bandwidth goal does not apply)"
        goals.append(text)
    return lines, goals


# ---------------------------------------------------------------------------------------------- end to end
def end_to_end_section(out: Path) -> tuple[list[str], list[str], dict]:
    """README lines for the end-to-end stage, the agreement goal lines, and ``meta.json``."""
    e2e = out / "end_to_end"
    meta = json.loads((e2e / "meta.json").read_text()) if (e2e / "meta.json").exists() else {}
    agree, timing = read_rows(e2e / "agreement_summary.csv"), read_rows(e2e / "timing.csv")
    lines = ["## End to end (`scripts/gpu_end_to_end.py`)", ""]
    if not meta:
        return lines + ["No `end_to_end/meta.json`: the stage did not run.", ""], [], meta
    cfg = meta.get("model_config", {})
    lines += [
        f"Model: random-weight `LlamaForCausalLM` with SmolLM2-135M's shapes ({cfg.get('num_hidden_layers')} "
        f"layers, hidden {cfg.get('hidden_size')}, {cfg.get('num_attention_heads')} query / "
        f"{cfg.get('num_key_value_heads')} KV heads, head dim {cfg.get('head_dim')}, intermediate "
        f"{cfg.get('intermediate_size')}, vocabulary {cfg.get('vocab_size')}), seed {meta.get('seed')}, "
        f"query/key projections x{meta.get('qk_gain')}; prompts of `Passage N:` documents and a question from "
        f"a {meta.get('tokenizer_vocab')}-token word tokenizer built in the script. compression_ratio "
        f"{meta.get('compression_ratio')}; EntroPrefill overrides {meta.get('entroprefill_overrides')}"
        + (f"; dry-run overrides {meta.get('dry_run_overrides')}" if meta.get("dry_run_overrides") else "")
        + f". Elapsed {meta.get('elapsed_s')} s.",
        "",
    ]
    lines += [
        "### Kept sets: device run vs CPU reference (float32, same weights and prompt)",
        "",
        "Reference: CPU, torch reference kernels (`KVPRESS_RESEARCH_KERNELS=reference`). Device: "
        + (
            "the GPU, Triton kernels forced (`KVPRESS_RESEARCH_KERNELS=triton`)"
            if not meta.get("dry_run")
            else "the CPU again with the Triton kernels interpreted (dry run)"
        )
        + ". Jaccard index of the kept prompt positions per (layer, KV group); EntroPrefill: its retained "
        "support (one set). `kernels`: the device's Triton run against the device's own torch-reference run "
        "(kernel differences alone, without CPU/GPU arithmetic differences). The probabilistic-eviction "
        "presses draw on a CPU generator per layer in every run; their kept sets are random draws, so their "
        "proposals are compared too (`proposal max abs diff`, device against CPU): a last-bit difference in a "
        "proposal can change the draws of its layer (the binomial splitting's rejection steps).",
        "",
    ]
    goals = []
    if agree:
        lines += markdown_table(
            [
                "press",
                "T",
                "layer x group",
                "mean Jaccard",
                "min Jaccard",
                "identical",
                "kept (ref / dev)",
                "kernels mean / min",
                "proposal max abs diff",
                "ref s",
                "dev s",
                "reference",
                "device",
                "error",
            ],
            [
                [
                    r["press"],
                    r["T"],
                    r["layer_groups"],
                    fmt(r["mean_jaccard"], ".4f"),
                    fmt(r["min_jaccard"], ".4f"),
                    fmt(r["identical_fraction"], ".1%"),
                    f"{r['kept_reference_mean'] or '-'} / {r['kept_device_mean'] or '-'}",
                    f"{fmt(r.get('kernels_mean_jaccard'), '.4f')} / {fmt(r.get('kernels_min_jaccard'), '.4f')}",
                    r.get("proposal_max_abs_diff") or "-",
                    r["reference_s"] or "-",
                    r["device_s"] or "-",
                    r["reference_detail"],
                    r["device_detail"],
                    r["error"],
                ]
                for r in agree
            ],
        )
        for r in agree:
            j = num(r["mean_jaccard"])
            goals.append(
                f"`{r['press']}` kept sets at T={r['T']}: mean Jaccard {fmt(j, '.4f')} "
                f"({'meets' if j >= GOALS['jaccard'] else 'misses'} {GOALS['jaccard']:.0%})"
                + (f"; proposals differ by at most {d}" if (d := r.get("proposal_max_abs_diff")) else "")
                + (f" [{r['error']}]" if r["error"] else "")
            )
    else:
        lines.append("No agreement rows.")
    lines += [
        "",
        f"### Timing ({timing[0]['dtype'] if timing else '-'}, decode {meta.get('decode_tokens')} greedy "
        "tokens after the prefill)",
        "",
        "`prefill s`: the prefill call inside `with press(model)`; `press s`: time inside the press's hooks; "
        "`KV kept`: physical (padded) and logical KV bytes against the full cache; peak memory: "
        "`torch.cuda.max_memory_allocated` over the row on a GPU (`mem_method` in timing.csv).",
        "",
    ]
    if timing:
        lines += markdown_table(
            ["T", "press", "prefill s", "press s", "decode tok/s", "KV kept (phys / logical)", "peak MB", "error"],
            [
                [r["T"], r["press"], *(fmt(r[k], ".4g") for k in ("prefill_s", "press_s", "decode_tok_s"))]
                + [f"{fmt(r['physical_vs_full'], '.1%')} / {fmt(r['logical_vs_full'], '.1%')}"]
                + [fmt(r["peak_mem_mb"], ".5g"), r["error"]]
                for r in timing
            ],
        )
    else:
        lines.append("No timing rows.")
    lines.append("")
    return lines, goals, meta


# ---------------------------------------------------------------------------------------------- README
def write_readme(out: Path, mode: str, command: str) -> str:
    """Write ``out/README.md`` and return its text."""
    stages = read_rows(out / "stages.csv")
    tests_lines, tests_ok = kernel_test_section(out)
    bench_lines, bench_goals = bench_section(out)
    e2e_lines, e2e_goals, meta = end_to_end_section(out)
    versions = meta.get("versions", {})
    dry = mode == "dry-run"
    lines = ["# GPU check (issue 19)", ""]
    if dry:
        lines += [
            "**DRY RUN on the CPU: a plumbing check, not a measurement.** The kernels ran under the Triton "
            "interpreter on toy shapes and the end-to-end model is a 2-layer toy; every number below only "
            "shows that the stages run and their tables get written.",
            "",
        ]
    lines += [
        f"- Device: `{meta.get('device', '-')}`",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) if versions else "- Versions: -",
        f"- Command: `{command}`",
        "",
    ]
    for name in ("env.txt", "install.txt"):
        if (out / name).exists():
            text = (out / name).read_text().strip()
            lines += [f"<details><summary>{name}</summary>", "", "```", text[:4000], "```", "", "</details>", ""]
    lines += ["## Goals (issue 19)", ""]
    if dry:
        lines += ["(Computed as on a GPU; in a dry run they judge nothing.)", ""]
    goal_lines = []
    if tests_ok is not None:
        goal_lines.append(
            f"Every kernel test passes {'(interpreted, dry run)' if dry else 'compiled'} in every dtype: "
            f"{'yes' if tests_ok else 'NO'}"
        )
    else:
        goal_lines.append("Kernel tests: no report")
    goal_lines += bench_goals or ["Kernel benchmark: no rows"]
    goal_lines += e2e_goals or ["Agreement: no rows"]
    lines += [f"- {g}" for g in goal_lines] + [""]
    if stages:
        lines += (
            ["## Stages", ""]
            + markdown_table(["stage", "exit code", "seconds"], [[s["stage"], s["rc"], s["seconds"]] for s in stages])
            + [""]
        )
    lines += tests_lines + bench_lines + e2e_lines
    lines += [
        "## How to run",
        "",
        "On a machine with one CUDA GPU and this repo's dependencies: `make gpu-check` "
        "(= `bash scripts/gpu_check.sh`), about 5 to 8 minutes; it writes this folder.",
        "",
        "On this workplace's device machine (no registry there): first, here, in the checkout the device tool "
        "sends, `bash scripts/gpu_check.sh --prepare` (downloads the pinned wheels into the git-ignored "
        "`wheels/`, about 15 MB); the tool sends at most 64 MiB of working tree, counted in disk blocks, which "
        "`results/` alone exceeds, so move `results/` aside but for `results/gpu` and `results/kernels` for the call "
        "(the header of `scripts/gpu_check.sh` has the commands); then call the device tool:",
        "",
        "```",
        RUN_CALL,
        "```",
        "",
        "The script installs the carried wheels into `/tmp/gpu_check_site` only where the machine lacks them "
        "(kvpress 0.5.5, transformers<5.3, hydra), and leaves `results_gpu.tar.gz`, `README.md` and "
        "`gpu_check.log` in `$OUT`; unpack with `tar xzf <files_at>/results_gpu.tar.gz -C results/`. "
        "A rerun of single stages: `bash scripts/gpu_check.sh --only bench,e2e,report`. "
        "CPU plumbing check: `bash scripts/gpu_check.sh --dry-run` (tests/test_gpu_check.py runs it).",
        "",
    ]
    text = "\n".join(lines)
    write_atomic(out / "README.md", text)
    return text


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the check's output folder (results/gpu)")
    p.add_argument("--mode", choices=("gpu", "dry-run"), default="gpu")
    p.add_argument("--command", default="bash scripts/gpu_check.sh")
    args = p.parse_args(argv)
    text = write_readme(Path(args.out), args.mode, args.command)
    goals = text.split("## Goals (issue 19)", 1)[1].split("\n## ", 1)[0].strip()
    print(goals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
