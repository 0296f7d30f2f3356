"""The native collectives: an all-reduce and an all-gather as C++ torch operators (collectives.cpp) that compiled
graphs call without entering Python; library.py builds and loads them, ops.py is their Python side (groups,
shapes for tracing, counts). docs/native.md says why and how."""
