"""The Ray Serve deployment (`MoerayServer`) and its application builder."""
