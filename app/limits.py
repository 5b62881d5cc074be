"""Limits the database columns set, named once (the API's checks and the services use them)."""

# the largest value an INTEGER column holds (PostgreSQL int4): ids, seeds, counts in requests
MAX_ID = 2**31 - 1
# the length of String columns that hold names (datasets, checkpoints, job workers, workers)
NAME_LENGTH = 200
# an upload's original filename as stored on its dataset (longer names are cut)
FILENAME_LENGTH = 300
# why a worker takes no job for now (its STORAGE_DIR cannot be written; longer reasons are cut)
HOLDING_LENGTH = 1000
# a vote's selection reason (how its pair was chosen)
SELECTION_LENGTH = 50
# a vote's client_vote_id (the client's retry key): 1-64 URL-safe characters
CLIENT_VOTE_ID_PATTERN = r"^[A-Za-z0-9._:-]{1,64}$"
# rows a service reads or writes per statement (an IN list, a bulk insert): under the bound
# parameters PostgreSQL (65,535) and SQLite (32,766) take in one statement, whatever the table
SQL_BATCH = 5000
# the leaderboard's bootstrap resamples of the Bradley-Terry fit (the 95% intervals): the
# default, and the most one request may ask for (each is a full fit)
DEFAULT_BOOTSTRAP = 200
MAX_BOOTSTRAP = 2000
# problems one 422 lists (the rest counted): a body with 300,000 unknown keys answered with a
# 31 MB list, built in the event loop for 30 s, the whole server waiting
MAX_PROBLEMS_LISTED = 100
# prompts a job's config may list itself (more belong in an uploaded dataset): a config is
# stored whole on its job and returned in every job listing
MAX_CONFIG_PROMPTS = 10_000
# checkpoints one evaluate job samples (its include_base's base among them): each is a model
# load and a full pass over the prompts and seeds
EVALUATE_MAX_CHECKPOINTS = 64
# how deeply a job config's values may nest (a field is a value, a list or an object of values:
# 1; deeper is refused by the field's type): a train config nested 500 deep overflowed Python's
# stack in the copy TrainConfig makes (a 500)
MAX_CONFIG_DEPTH = 16
