"""The logic. Each function takes a Session as its first argument and does not commit unless
its docstring says so; routers and worker tasks own the transaction boundary."""
