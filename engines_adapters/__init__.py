"""Everything that talks to an engine, and the simulated engine."""
