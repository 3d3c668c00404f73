"""Context parallelism planning: which rank owns which chunks (`dispatch`), which key/value rows
move where (`comm`), in how many overlapped stages (`stages`), all in one `Plan` (`plan`). Pure
CPU; the runtime that executes a plan is maskc.runtime."""

from maskc.dist.plan import Plan, make_plan

__all__ = ["Plan", "make_plan"]
