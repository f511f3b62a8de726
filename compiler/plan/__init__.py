"""The planner: mesh, sharding rules, remat policy and microbatches for a model on a topology.

    plan(spec, topology, seq=, batch=, pins=)  -> Plan   (search.py)
    Plan.load(path) / plan.save(path)                     (plan.py)
    plan_mesh(plan, topology), lower_train_step(spec, plan, mesh)   (verify.py; built by mxc.compiler.aot)
"""

from mxc.compiler.plan.plan import MESH_AXES, Plan
from mxc.compiler.plan.search import PlanError, plan

__all__ = ["MESH_AXES", "Plan", "PlanError", "plan"]
