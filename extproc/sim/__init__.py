"""The vLLM-like replica simulator (issue #3).

Programmatic use (tests, benchmark harness)::

    from extproc.sim import SimConfig, start_sim
    sim = await start_sim(SimConfig(port=0, time_scale=10))
    ...  # sim.url, sim.port, sim.admin_port, sim.engine, await sim.apply_fault("slow", 5)
    await sim.stop()

Modules: ``engine`` (scheduler, KV blocks, cost; pure logic), ``presets`` (cost constants),
``runner`` (real-time stepping), ``server`` (HTTP), ``metrics``, ``faults``, ``tokenizer``,
``calibrate``, ``cli``.
"""

from .engine import Engine, Request, run_offline
from .presets import PRESETS, CostModel, Preset, get_preset
from .server import PortInUse, SimConfig, SimError, SimServer, start_sim

SimHandle = SimServer

__all__ = [
    "Engine",
    "Request",
    "run_offline",
    "PRESETS",
    "CostModel",
    "Preset",
    "get_preset",
    "SimConfig",
    "SimServer",
    "SimHandle",
    "SimError",
    "PortInUse",
    "start_sim",
]
