"""Search over an index version: versions and their cards opened and checked, id maps, the `Searcher` and the
searchers that follow aliases, filters, fusion and routing; and the query sets and metrics that measure them."""
