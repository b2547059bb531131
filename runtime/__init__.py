"""The mechanics of devices: slices, meshes over the healthy ones, resharding, failure classification."""

from . import hangs, simulated
from .batching import Chunk, plan_microbatches
from .classify import FailureKind, SliceLostError, classify_failure, is_recoverable, is_slice_loss
from .faults import DeviceUnavailableError, TransientUnavailableError
from .freeing import discard, held_bytes, release
from .freeing import flush as flush_releases
from .freeing import wake as wake_releases
from .guard import StepHungError, guarded, wait_ready
from .health import SliceProbe, probe_slices, warm_probes
from .landing import LAND, Landed, land, land_args, landing, landing_pays, owned, refusal
from .mesh import LOCAL_AXIS, REPLICA_AXIS, MeshFn, batch_sharding, build_mesh, replicated
from .reshard import StructureError, as_shardings, check_structure, reshard
from .standby import StandbyCompiler, mesh_key
from .topology import Slice, Topology, TopologyError, device_topology, simulated_topology, topology_from_devices

__all__ = (
    "Chunk",
    "DeviceUnavailableError",
    "LAND",
    "FailureKind",
    "LOCAL_AXIS",
    "MeshFn",
    "REPLICA_AXIS",
    "Slice",
    "SliceProbe",
    "SliceLostError",
    "StepHungError",
    "StructureError",
    "Topology",
    "TransientUnavailableError",
    "TopologyError",
    "as_shardings",
    "batch_sharding",
    "build_mesh",
    "check_structure",
    "classify_failure",
    "discard",
    "flush_releases",
    "guarded",
    "hangs",
    "held_bytes",
    "is_recoverable",
    "is_slice_loss",
    "land",
    "Landed",
    "land_args",
    "landing",
    "landing_pays",
    "owned",
    "refusal",
    "plan_microbatches",
    "probe_slices",
    "release",
    "replicated",
    "reshard",
    "simulated",
    "device_topology",
    "simulated_topology",
    "StandbyCompiler",
    "mesh_key",
    "topology_from_devices",
    "wait_ready",
    "wake_releases",
    "warm_probes",
)
