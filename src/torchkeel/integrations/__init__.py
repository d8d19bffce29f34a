"""torchkeel inside other engines' workers (Ray Train). Each integration imports its engine only
when used; the engine is an optional dependency."""
