"""The expert worker core shared by the GPU and CPU expert servers: slot table, servicer,
server factory. The servers differ only in the :class:`~expertmesh.experts.ExpertBackend`
they plug in and their defaults."""
