"""Checks whether the profile's per-block memory terms are affine in the micro-batch size.

    scripts/ckptune profile resnet18 --batch 2,4,6 --global-batch 12 -o mb.json
    .venv/bin/python scripts/affinity.py mb.json

Takes every three profiled sizes of one precision/optimizer and reports each term whose second
difference is not zero (exact integers: an affine term has none). If every term were affine,
two profiled sizes would determine all others; where some are not (convolution backward
workspaces, whose algorithm changes with the batch), ckptune profiles each requested size.
"""

import itertools
import json
import sys

TERMS = ["kept_grad", "fwd_transient_grad", "kept_nograd", "fwd_transient_nograd", "carry", "bwd_transient",
         "rec_transient", "kept_recompute", "bwd_transient_ckpt"]


def main(path):
    p = json.load(open(path))
    groups = {}
    for c in p["configs"]:
        k = c["config"]
        groups.setdefault((k["precision"], k["optimizer"]), []).append(c)
    bad = 0
    total = 0
    for (prec, opt), cs in sorted(groups.items()):
        cs.sort(key=lambda c: c["config"]["micro_batch"])
        for a, b, c in itertools.combinations(cs, 3):
            xa, xb, xc = (x["config"]["micro_batch"] for x in (a, b, c))
            print(f"{p['model']['name']} {prec}/{opt}: micro-batches {xa}, {xb}, {xc} (first micro-step regime)")
            ra, rb, rc = (x["regimes"][0] for x in (a, b, c))
            for ba, bb, bc in zip(ra["blocks"], rb["blocks"], rc["blocks"]):
                for t in TERMS:
                    total += 1
                    ya, yb, yc = ba[t], bb[t], bc[t]
                    # Affine through (xa, ya) and (xc, yc), evaluated at xb, times (xc - xa).
                    lhs = yb * (xc - xa)
                    rhs = ya * (xc - xb) + yc * (xb - xa)
                    if lhs != rhs:
                        bad += 1
                        print(f"  not affine: {ba['name']}.{t}: {ya}, {yb}, {yc} bytes "
                              f"(off the line by {(lhs - rhs) / (xc - xa):+.0f} B at micro-batch {xb})")
    print(f"{total - bad} of {total} block terms are affine in the micro-batch")


if __name__ == "__main__":
    main(sys.argv[1])
