"""Triton kernels, one op per module; see each module header for the math and costs."""
