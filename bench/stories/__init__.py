"""The workshop of `pdserve-stories`, the embedded model that writes simple, readable English: a
seeded grammar of short stories and chat turns (`grammar`) generates its training corpus
(`corpus`) and recognizes its output (`recognizer`), and `train` trains it on the CPU with the
engine's own layers. The checkpoint it made ships in `engine/embedded/pdserve-stories/`; nothing
in the product imports this package (benchmarks and tests use the grammar and recognizer)."""
