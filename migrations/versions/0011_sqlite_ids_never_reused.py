"""SQLite never reuses the id of a deleted dataset or prompt (AUTOINCREMENT).

Without AUTOINCREMENT SQLite gives a new row the largest id + 1, so deleting the newest
dataset and uploading another handed the new one the old id: a job that remembers the deleted
dataset (jobs.submitted_dataset_id, revision 0009) then resumed on the new dataset's prompts
instead of being refused, and exports and rollouts that name a prompt id could name a
different prompt. PostgreSQL's sequences never go back, so it is unchanged.

SQLite adds AUTOINCREMENT only by rebuilding the table (migrations/env.py turns foreign key
enforcement off around migrations for that). The sequence starts above every id that rows
elsewhere still remember, so ids deleted before this revision are not handed out again either.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02 21:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# table -> the columns elsewhere that remember its ids after a row is deleted (foreign keys
# are set null on delete, so only plain columns can)
REMEMBERED = {
    'datasets': [('jobs', 'submitted_dataset_id')],
    'prompts': [],
}


def _rebuild(table: str, autoincrement: bool) -> None:
    with op.batch_alter_table(table, recreate='always',
                              table_kwargs={'sqlite_autoincrement': autoincrement}):
        pass


def upgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name != 'sqlite':
        return
    for table, remembered in REMEMBERED.items():
        _rebuild(table, autoincrement=True)
        highest = max([conn.execute(sa.text(f'SELECT max(id) FROM {table}')).scalar() or 0]
                      + [conn.execute(sa.text(f'SELECT max({column}) FROM {other}')).scalar() or 0
                         for other, column in remembered])
        # the copy of the rows set the sequence to the largest id copied; raise it to what
        # other tables remember
        conn.execute(sa.text('DELETE FROM sqlite_sequence WHERE name = :t'), {'t': table})
        conn.execute(sa.text('INSERT INTO sqlite_sequence (name, seq) VALUES (:t, :seq)'),
                     {'t': table, 'seq': highest})


def downgrade() -> None:
    if op.get_bind().dialect.name != 'sqlite':
        return
    for table in REMEMBERED:
        _rebuild(table, autoincrement=False)
