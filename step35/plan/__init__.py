"""`step35 plan`: will a training config fit on its devices, and how fast could it go.

settings (the fit parser) -> world (fake process group, meta model, real sharding) -> state, activations,
memory phases, speed -> report; suggest tries nearby layouts, a LoRA fine-tune and context parallelism.
A LoRA run (model.lora) is counted by lora.py: frozen base, adapters, their activations; Step-3.7's vision side
on the devices (model.vision) by vision.py: what its forward keeps per image. See docs/plan.md.
"""

from step35.plan.planner import Plan, make_plan

__all__ = ["Plan", "make_plan"]
