"""kvmesh store tiers in front of the store client (L1 CPU pool: :mod:`.l1`)."""
