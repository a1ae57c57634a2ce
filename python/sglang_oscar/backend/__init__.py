"""The OSCAR attention backend for SGLang (Triton backend subclass) and served rotations."""
