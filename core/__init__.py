"""The minimal core: contracts (config, hookspecs, requests) and the mechanisms that are not a choice."""
