"""Host-memory tier (T1): a DRAM page pool in a TP-agnostic canonical layout."""
