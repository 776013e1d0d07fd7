"""The Ray actor of one rank: lockstep loop, output channel, shared-memory collective, rendezvous."""
