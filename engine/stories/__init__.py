"""`pdserve-stories`: the embedded model that writes simple, readable English. A seeded grammar of
short stories and chat turns generates its training corpus and recognizes its output; `train.py`
trains it on the CPU; the checkpoint ships in `engine/stories/pdserve-stories/`."""
