"""Issue 13's attacks, repeated against a default ``kvmesh up``-style mesh (mTLS, API keys
of two tenants, a store master beside it): each is refused, and nothing changed."""
