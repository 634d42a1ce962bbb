"""The compiler: discover → order → decode/resize into shards → finish (compact, index) → publish.

`pipeline.compile_folder` is the whole pipeline in one short function; each stage is its own
module: `discover` (`classes`: vocabularies, `labels`: label tables), `write` (`decode` +
`resize` into record slots, run by an engine from `engines`), `journal` (what a partial build
holds, for --resume), `finish` (compaction, index; files written by `output`) and `publish`
(the build made the dataset at OUT). `jobs` holds the types they share. Importing one stage
imports only what it needs: this package module imports nothing.
"""
