"""The client side of each algorithm family: its phases (handlers the registry lists) and typed state.

setup.py holds the phases every LoJ algorithm shares (keys, federated preprocessing, VFL expansion, the
label owner's evaluation); join_sgd.py, join_admm.py and union.py the training phases of their families.
Each module declares its phases (handler(client, arrays, config) -> (arrays, metrics)) as tpflower.guard
``Phase`` / ``Stage`` objects: who answers them and in which order; setup.loj_protocol assembles an
algorithm's protocol, which the registry entry carries and the client's guard enforces.
"""
