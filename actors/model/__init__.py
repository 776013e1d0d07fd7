"""The model of one rank: config, checkpoint weights, layers, attention and the decoder forward."""
