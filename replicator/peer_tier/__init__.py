"""The peer tier: replicas of committed steps on other nodes' ramdisks, over HTTP between node agents.

``protocol`` holds the URL paths both halves share, ``service`` the serving half, ``client`` the
fetching and pushing half.
"""
