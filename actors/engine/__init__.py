"""One rank's engine: scheduler, sampling, detokenizer, router <-> rank messages."""
