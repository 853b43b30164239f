"""Pure scheduling decisions: hashing, hit index, ledger, cost model, policies, admission. No I/O."""
