//! kvgate-filter (being built)
