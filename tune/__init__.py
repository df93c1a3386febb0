"""`pdserve tune`: a discrete-event simulator of a pdserve deployment that runs pdserve's own
scheduler, block manager, nodes and coordinator against modeled step and transfer times, the
profiles those models come from, and a search of deployments for the most goodput under an SLO.
"""
