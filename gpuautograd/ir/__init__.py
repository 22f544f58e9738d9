"""The IR: programs of SSA values over one table of ops (`registry`).

Every module that registers rows in the table is imported here, so the table is whole once the
package is: the op modules import the registry, and nothing imports them back.
"""

from . import complex_ops, composite_ops, decomposition_ops, extern_ops, extern_sequence_ops, hook_ops, linalg_ops, ops  # noqa: F401
