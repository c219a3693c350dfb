"""Auto-configuration (the planner): profiles, the memory model, the search, and the choice at setup.

Modules: :mod:`~.choice` (at setup, agreed on every rank), :mod:`~.search`, :mod:`~.memory_model`,
:mod:`~.profile_data`, :mod:`~.profiler`, :mod:`~.segment_profiler`.
"""
