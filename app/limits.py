"""Limits the database columns set, named once (the API's checks and the services use them)."""

# the largest value an INTEGER column holds (PostgreSQL int4): ids, seeds, counts in requests
MAX_ID = 2**31 - 1
# the length of String columns that hold names (datasets, checkpoints, job workers, workers)
NAME_LENGTH = 200
