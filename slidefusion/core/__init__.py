"""The bottom of the package: what every other part may import and nothing here imports back.

errors (`UserError`, `check`, the one `unknown_value` message), validate (checks of user values),
hooks (the one hook registry), grids (the token grid), dtypes (the dtype table), native (the one
build helper for compiled kernels).
"""
