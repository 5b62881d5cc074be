"""datasets.name unique: the upload's name check (a 409 naming the dataset that has it) could be
passed by two uploads racing with one name; the constraint closes the race. Datasets that share
a name from before the check keep their prompts and get their id appended to the name
("name (id)") so that every dataset stays, each under a name of its own.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29 17:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

NAME_LENGTH = 200  # app.limits.NAME_LENGTH when this revision was written


def upgrade() -> None:
    conn = op.get_bind()
    datasets = sa.table('datasets', sa.column('id', sa.Integer), sa.column('name', sa.String))
    rows = list(conn.execute(sa.select(datasets.c.id, datasets.c.name).order_by(datasets.c.id)))
    used = {name for _, name in rows}  # a new name must not be any dataset's, old or new
    kept: set[str] = set()
    renames: list[tuple[int, str]] = []
    for dataset_id, name in rows:
        if name not in kept:  # the oldest keeps the name; a later one gets its id beside it
            kept.add(name)
            continue
        n, suffix = 1, f" ({dataset_id})"
        while (new := name[:NAME_LENGTH - len(suffix)] + suffix) in used:
            n += 1
            suffix = f" ({dataset_id}-{n})"
        used.add(new)
        kept.add(new)
        renames.append((dataset_id, new))
    for dataset_id, name in renames:
        conn.execute(datasets.update().where(datasets.c.id == dataset_id).values(name=name))
    # a unique index, not a constraint: SQLite adds an index in place, where a constraint
    # would rebuild the table, and dropping the old table would cascade to every prompt
    op.create_index('ux_datasets_name', 'datasets', ['name'], unique=True)


def downgrade() -> None:
    # the renamed datasets keep their new names: which of them shared a name is not recorded
    op.drop_index('ux_datasets_name', table_name='datasets')
