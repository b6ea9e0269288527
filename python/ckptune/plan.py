"""Reading the plan document (`ckptune.plan/1`, defined in planner/solver/src/formats/plan.rs)."""

import json
import os
from typing import Any, Dict, Union

FORMAT = "ckptune.plan/1"

PlanLike = Union[str, "os.PathLike[str]", Dict[str, Any]]


def load_plan(plan: PlanLike) -> Dict[str, Any]:
    """The plan as a dict, from a path to its JSON or from an already parsed dict.

    The format tag is checked because the fields this package reads (`checkpoint`, `config`,
    `model.modules`) are those of version 1; a plan of another version would be misread
    silently, so it is refused and the message says to plan again with this ckptune.
    """
    if isinstance(plan, dict):
        doc = plan
    else:
        with open(plan, encoding="utf-8") as f:
            doc = json.load(f)
        if not isinstance(doc, dict):
            raise ValueError(f"{os.fspath(plan)} is not a ckptune plan: expected a JSON object, "
                             f"found {type(doc).__name__}")
    found = doc.get("format")
    if found != FORMAT:
        raise ValueError(f"unsupported plan format {found!r}: expected {FORMAT!r}; re-plan with "
                         f"this ckptune (`ckptune plan ... -o plan.json`)")
    return doc
