"""Online expert prediction: which experts the next layer will use, for the expert cache's prefetch."""
