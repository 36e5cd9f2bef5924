"""Shared math below both the kernels and the presses: Rényi entropy and group pooling, pages and budgets,
observer queries, attention column sums, the coupon-collector expectation. Each module has one job and
imports only torch (and kvpress/transformers helpers), never a press or a kernel; docs/methods.md.
"""
