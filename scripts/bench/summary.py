"""Prints a short plain-text summary of bench.json (what `scripts/bench/run` shows at the end).

    python scripts/bench/summary.py results/bench/bench.json
"""

import json
import sys


def size(b):
    return f"{b / 2**20:,.2f} MiB" if b >= 10 * 2**20 else f"{b:,} B"


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: summary.py bench.json")
    with open(sys.argv[1]) as f:
        b = json.load(f)
    print(f"{b['mode']} run, {b['date_utc']}, {b['machine']['cpu']} ×{b['machine']['nproc']}, "
          f"torch {b['torch']}, {b['wall_seconds'] / 60:.1f} min")
    print("\n1. runtime vs PyTorch eager (ckptune / PyTorch; target ≤ 1.00)")
    print(f"  {'model':<18} {'prec':<5} {'set':<22} {'time':>7} {'peak':>9} {'above start':>12}")
    for r in b["models"].values():
        for x in r["runtime"]:
            print(f"  {r['model']:<18} {x['precision']:<5} {x['set']:<22} {x['time_ratio']:>6.3f}× "
                  f"{x['peak_ratio']:>8.5f}× {x['peak_above_start_ratio']:>11.5f}×")
    print("\n2. plan quality (measured; time vs the reference row)")
    for r in b["models"].values():
        for q in r["quality"]:
            c = q.get("confirm")
            conf = ""
            if c is not None:
                conf = ("; plan = exhaustive best's set" if c["same_set"] else
                        f"; re-measured A/B: plan {c['time_vs_ref']:.3f}× best")
            print(f"  {r['model']} budget {size(q['budget'])} (ref: {q['reference']}{conf})")
            for x in q["rows"]:
                print(f"    {x['strategy']:<34} {size(x['peak_bytes']):>16} "
                      f"{'fits' if x['fits'] else 'OVER'}  {x['step_seconds']:.4f} s  {x['time_vs_ref']:.3f}×")
    print("\n3. profiling cost")
    for r in b["models"].values():
        al = r["profcost"]["alternatives"]
        for x in r["profcost"]["rows"]:
            print(f"  {x['model']} ({x['granularity']}, N={x['candidates']}): {x['steps_run']} steps, "
                  f"{x['wall_seconds']:.2f} s")
        print(f"    vs per-candidate {al['per_candidate_steps']} steps (≈{al['per_candidate_seconds_est']:.2f} s), "
              f"all subsets {al['all_subsets_steps']:,} steps (≈{al['all_subsets_seconds_est']:,.2f} s)")
    print("\n4. prediction error over verified plans")
    for r in b["models"].values():
        for v in r["accuracy"]["verified"]:
            print(f"  {r['model']} budget {size(v['budget'])}: peak error {v['peak_error_bytes']:+,} B "
                  f"({100 * v['peak_error_relative']:+.4f}%), step error {100 * v['step_error_relative']:+.1f}%, "
                  f"{'within budget' if v['within_budget'] else 'OVER BUDGET'}")


if __name__ == "__main__":
    main()
