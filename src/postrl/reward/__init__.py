"""The Reward Service (:mod:`postrl.reward.service`). Nothing is imported here: scoring worker
processes import only what they run (importing torch through the service would add ~2 s to every
worker (re)start)."""
