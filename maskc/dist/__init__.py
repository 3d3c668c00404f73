"""Context parallelism: which rank owns which chunks (`assign`), which key/value rows move where
(`comm`), in how many overlapped stages (`stages`), all in one `Plan` (`plan`, pure CPU); what
each rank derives from it, or prepares ahead in a DataLoader worker (`local`); and running it
over torch.distributed (`execute`: dispatch / undispatch of sequence tensors and distributed
attention, forward and backward)."""

from maskc.dist.execute import attention, dispatch, undispatch
from maskc.dist.local import PlanningCollate, PreparedPlan, prepare_plan
from maskc.dist.plan import Plan, make_plan

__all__ = ["Plan", "PlanningCollate", "PreparedPlan", "attention", "dispatch", "make_plan", "prepare_plan", "undispatch"]
