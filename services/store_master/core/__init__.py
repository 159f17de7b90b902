"""The store master's pure core (no grpc, redis or asyncio; the clock and rng are injected).

- ``deps``: the clock and random-source types the core is given;
- ``states``: replica states and transitions, pins, object metadata, errors and their kinds;
- ``allocator``: per-segment first-fit allocator and allocation strategies;
- ``eviction``: eviction policies (exact and sampled LRU);
- ``records``: durable records for persistence;
- ``master``: :class:`StoreMaster`, which ties them together.
"""

from services.common.injected import Clock, Rng
from services.store_master.core.allocator import (
    STRATEGIES,
    AllocationStrategy,
    FreeRatioFirstStrategy,
    RandomStrategy,
    RangeAllocator,
    Segment,
    make_strategy,
)
from services.store_master.core.eviction import (
    POLICIES,
    Candidate,
    EvictionPolicy,
    LruPolicy,
    SampledLruPolicy,
    make_eviction_policy,
)
from services.store_master.core.master import (
    Counters,
    LossReport,
    MasterParams,
    RestoreReport,
    Stats,
    StoreMaster,
    TickReport,
)
from services.store_master.core.records import Changes, decode, encode
from services.store_master.core.states import (
    AlreadyExists,
    ErrorKind,
    Forbidden,
    IllegalTransition,
    InvalidInput,
    Leased,
    NoSpace,
    NotFound,
    NotReady,
    ObjectMeta,
    Pin,
    Replica,
    ReplicaDescriptor,
    ReplicaState,
    StoreError,
    WrongState,
)

__all__ = [
    "POLICIES", "STRATEGIES", "AllocationStrategy", "AlreadyExists", "Candidate", "Changes",
    "Clock", "Counters", "ErrorKind", "EvictionPolicy", "Forbidden", "FreeRatioFirstStrategy",
    "IllegalTransition", "InvalidInput", "Leased", "LossReport", "LruPolicy", "MasterParams",
    "NoSpace", "NotFound", "NotReady", "ObjectMeta", "Pin", "RandomStrategy",
    "RangeAllocator", "Replica", "ReplicaDescriptor", "ReplicaState", "RestoreReport", "Rng",
    "SampledLruPolicy", "Segment", "Stats", "StoreError", "StoreMaster", "TickReport",
    "WrongState", "decode", "encode", "make_eviction_policy", "make_strategy",
]
