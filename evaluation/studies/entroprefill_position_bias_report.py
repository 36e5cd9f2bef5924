"""Summary of EntroPrefill's position-bias study (issue 15 item 4): every configuration run on the development
seed, its key numbers, and the attention probe, in one table written to
``results/entroprefill/position_bias/README.md``.

It reads only committed outputs (no model run): the ``summary.csv``, ``survival.csv`` and ``README.md`` (for the
command) of every study directory listed in ``STUDIES``, and ``probe/probe.csv``. Regenerate with (``python -m
evaluation.studies.entroprefill_position_bias_report`` is the same)::

    python scripts/entroprefill_position_bias_report.py

Every study listed ran BEFORE EntroPrefill's defaults changed to ``proposal_observers="query"`` and
``monitored_layers`` = ``L//2-2 .. L//2+2``; a command without an override therefore ran the earlier defaults
(``DEFAULTS_AT_RUN_TIME``). Rerunning such a command today runs the new defaults; pass the overrides explicitly
(``--press proposal_observers=suffix 'monitored_layers=[10,11,12,13,14]'``) to reproduce it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from evaluation.atomic import write_atomic
from evaluation.cli import ArgumentParser
from evaluation.studies import REPO as ROOT
from evaluation.tables import fmt, num, read_rows

BASE = "results/entroprefill"
# (directory under results/entroprefill, what it varies), in the order they were run
STUDIES = [
    ("position_bias/default", "earlier defaults"),
    ("position_bias/reversed", "earlier defaults, passages reversed"),
    ("position_bias/rope_free", "earlier defaults, chunk scores without positions (RoPE removed; diagnostic)"),
    ("position_bias/query_observers", "observers: whole query span"),
    ("position_bias/suffix_observers_layers13-17", "layers 13-17"),
    ("position_bias/query_observers_layers13-17", "query observers + layers 13-17 (the new defaults)"),
    ("position_bias/query_observers_layers13-17_reversed", "the new defaults, passages reversed"),
    ("dev_4k_ratio", "the new defaults at 4k, with full prefill, two compression ratios"),
]
DEFAULTS_AT_RUN_TIME = {"proposal_observers": "suffix", "monitored_layers": "10-14"}


def command(study_dir: Path) -> str:
    m = re.search(r"Command: `(.+?)`\s*$", (study_dir / "README.md").read_text(), re.M)
    return m.group(1) if m else "?"


def configuration(cmd: str, variant_spec: list[str]) -> dict[str, str]:
    """The EntroPrefill fields and study options a bench command ran with (overrides, else the earlier defaults)."""
    argv = shlex.split(cmd)
    press: dict[str, str] = {}
    i = 0
    while i < len(argv):
        if argv[i] == "--press":
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                k, v = argv[i].split("=", 1)
                press[k] = v
                i += 1
            continue
        i += 1
    press.update(kv.split("=", 1) for kv in variant_spec)
    layers = press.get("monitored_layers", DEFAULTS_AT_RUN_TIME["monitored_layers"])
    nums = [int(x) for x in re.findall(r"\d+", layers)]
    if layers.startswith("[") and nums == list(range(nums[0], nums[-1] + 1)):
        layers = f"{nums[0]}-{nums[-1]}"
    return {
        "observers": press.get("proposal_observers", DEFAULTS_AT_RUN_TIME["proposal_observers"]),
        "layers": layers,
        "ratio": press.get("compression_ratio", _opt(argv, "--compression-ratio", "0.5")),
        "order": "reversed" if "--reverse-passages" in argv else "as built",
        "scores": _opt(argv, "--scores", "model"),
        "lengths": _opt(argv, "--lengths", "?"),
        "seed": _opt(argv, "--seed", "?"),
    }


def _opt(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def variant_specs(cmd: str) -> dict[str, list[str]]:
    argv = shlex.split(cmd)
    specs, i = {}, 0
    while i < len(argv):
        if argv[i] == "--variant":
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            specs[argv[i + 1]] = argv[i + 2 : j]
            i = j
            continue
        i += 1
    return specs


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=f"{BASE}/position_bias/README.md")
    args = ap.parse_args(argv)
    base = ROOT / BASE
    header = [
        "study",
        "varies",
        "seed",
        "length",
        "observers",
        "layers",
        "ratio",
        "order",
        "scores",
        "n",
        "bypass",
        "answer removed",
        "survival 1st half (n)",
        "survival 2nd half (n)",
        "survival by depth quarter [0,25) / [25,50) / [50,75) / [75,100]",
        "acc EntroPrefill",
        "acc full",
        "answer rank",
        "priority-index Spearman",
        "accepted layer",
        "T'/T",
        "CPU time ratio",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for rel, what in STUDIES:
        d = base / rel
        cmd = command(d)
        specs = variant_specs(cmd)
        survival = read_rows(d / "survival.csv")
        for s in read_rows(d / "summary.csv"):
            variant = s.get("variant", "entroprefill")
            cfg = configuration(cmd, specs.get(variant, []))
            quarters = [
                r
                for r in survival
                if r["target_length"] == s["target_length"] and r.get("variant", "entroprefill") == variant
            ]
            q = " / ".join(f"{fmt(r['answer_survival'], '.2f')} ({r['n_pruned']})" for r in quarters)
            name = f"`{rel}`" + (f" `{variant}`" if "variant" in s else "")
            lines.append(
                "| "
                + " | ".join(
                    [
                        name,
                        what,
                        cfg["seed"],
                        s["target_length"],
                        cfg["observers"],
                        cfg["layers"],
                        cfg["ratio"],
                        cfg["order"],
                        cfg["scores"],
                        s["n"],
                        fmt(s["bypass_freq"], ".2f"),
                        fmt(s["answer_removed_freq"], ".2f"),
                        f"{fmt(s['survival_first_half'], '.2f')} ({s['n_first_half']})",
                        f"{fmt(s['survival_second_half'], '.2f')} ({s['n_second_half']})",
                        q,
                        fmt(s["acc_entroprefill"], ".2f"),
                        fmt(s["acc_full"], ".2f"),
                        fmt(s["mean_answer_rank"], ".2f"),
                        fmt(s["mean_priority_index_spearman"], ".2f"),
                        fmt(s["mean_accepted_layer"], ".1f"),
                        fmt(s["mean_T_prime_over_T"], ".2f"),
                        fmt(s["cpu_time_ratio"], ".2f"),
                    ]
                )
                + " |"
            )

    probe = read_rows(base / "position_bias/probe/probe.csv")
    probe_lines = [
        "| observers | layers where the answer passage gets the most mass in >= half of the examples "
        "| layers with head-averaged lift > 2 | max lift (layer) | mean Spearman over layers |",
        "|---|---|---|---|---|",
    ]
    for obs in ("suffix", "query", "key", "answer"):
        rows = sorted((r for r in probe if r["observers"] == obs), key=lambda r: int(r["layer"]))
        top = [r["layer"] for r in rows if num(r["top"]) >= 0.5]
        lift2 = [r["layer"] for r in rows if num(r["lift_mean"]) > 2]
        best = max(rows, key=lambda r: num(r["lift_mean"]))
        sp = sum(num(r["spearman"]) for r in rows) / len(rows)
        probe_lines.append(
            f"| `{obs}` | {', '.join(top) or 'none'} | {', '.join(lift2) or 'none'} | "
            f"{fmt(best['lift_mean'], '.2f')} ({best['layer']}) | {sp:.2f} |"
        )

    commands = [f"- `{rel}`: `{command(base / rel)}`" for rel, _ in STUDIES]
    commands.append(f"- `position_bias/probe`: `{command(base / 'position_bias/probe')}`")
    text = "\n".join(
        [
            "# EntroPrefill's position bias: every configuration tried on the development seed",
            "",
            "Generated by `python scripts/entroprefill_position_bias_report.py` from the `summary.csv`, `survival.csv`"
            " and `README.md` of each study directory below (do not edit by hand). Set: `keyfacts` "
            "(evaluation/datasets/keyfacts.py, `distractor_facts=none`), development seed 1000 (the reporting "
            "seed 0 was not used for any choice), model `smollm2-135m`, query-aware, CPU, one torch thread, "
            "compression_ratio 0.5 unless stated. Every study ran before the defaults changed: `observers`/`layers` "
            f"without an override are the earlier defaults ({DEFAULTS_AT_RUN_TIME['proposal_observers']}, "
            f"{DEFAULTS_AT_RUN_TIME['monitored_layers']}); rerunning an override-free command today runs the new "
            "defaults (query, 13-17).",
            "",
            "Columns: `bypass`: fraction of examples bypassed (full prefill kept); `answer removed` and `survival`: "
            "among pruned examples, whether EntroPrefill removed the answer passage, by the answer passage's position "
            "(halves, and quarters of the passage list with the number of pruned examples); `acc EntroPrefill`: "
            "accuracy of the answer decoded after EntroPrefill's prefill (the uncompressed model scores 1.00 on this "
            "seed at 2k and 4k, `results/entroprefill/keyfacts_dev/`); `acc full`: measured in the same run only "
            "where the study did not pass `--skip-full`; `answer rank`: the answer passage's rank by priority S_i "
            "(0 = kept first, 1 = removed first); `priority-index Spearman`: > 0 when later passages rank higher; "
            "`CPU time ratio`: EntroPrefill / full prefill process CPU time (only with full prefill in the run).",
            "",
            *lines,
            "",
            "## The attention probe (`probe/`)",
            "",
            "One uncompressed forward per example (10 examples at 2k, seed 1000); for each observer set the answer "
            "passage's lift (its share of the rows' passage mass / its share of the passage tokens; 1 = no "
            "preference). `suffix`: the last 8 prefill tokens (the earlier default observers); `query`: the query "
            "span; `key`: the question's key tokens; `answer`: the answer prefix's last token after the prefill "
            "(what the model reads from when it answers; not observable by EntroPrefill). Full table: "
            "`probe/README.md`.",
            "",
            *probe_lines,
            "",
            "## Conclusion: the bias was ours",
            "",
            "- The removals followed position, not content. With the earlier defaults EntroPrefill removed the "
            "answer passage in 58% of the pruned examples, every time when it sat in the first quarter, never in the "
            "last; reversing the passage order moved the losses with the position (the first quarter still lost "
            "everything), so it was not which passage holds the fact.",
            "- The model's attention has a recency gradient (positive passage-index Spearman at almost every layer "
            "for every observer set), but the model does find the answer passage: from the question's key tokens "
            "at layers 7, 14, 17, 18, 21 and 23, and from the answer position at 21 and 23. The earlier defaults "
            "looked where it does not: the last 8 prompt tokens are template (`... in the passages?` `Answer:`) "
            "and at no layer give the answer passage the most mass, and the monitored layers 10-14 are where no "
            "observer "
            "set finds it (layer 14 only for the key tokens). Our choices of observers and layers exposed the "
            "press to the recency gradient: that part is ours, not the model's.",
            "- Either change alone is not enough (query observers at layers 10-14: 60% removed; suffix observers "
            "at 13-17: 38% removed). Together (query observers, layers 13-17) no pruned example lost its answer "
            "passage: 0 of 17 at 2k, 0 of 15 with the passages reversed, 0 of 10 at 4k, with EntroPrefill's "
            "accuracy 1.00 in all three. These are now the defaults (docs/methods.md §4, parameters table).",
            "- Removing positions from the chunk scores (`rope_free`) is no fix: every example bypassed "
            "(target infeasible or no layer accepted); the priorities then anti-correlate with the index (-0.27), "
            "so positions matter to this model's attention and cannot simply be divided out.",
            "- The cost: later layers save less. Bypasses rose from 5% to 15-25% at 2k, and at 4k the CPU time ratio "
            "is 0.74 (ratio 0.5), short of the issue's 0.6 goal; asking for more (ratio 0.8) bypasses 70% of the "
            "examples (no layer accepted) and gives 0.87. Small dev samples (n = 10-20): the seed-0 benchmark "
            "(`results/entroprefill/keyfacts/`, n = 40 per length) is the reported figure.",
            "",
            "## Commands",
            "",
            *commands,
            "",
        ]
    )
    out = ROOT / args.out
    write_atomic(out, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
