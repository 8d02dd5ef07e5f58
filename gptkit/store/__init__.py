"""Where runs are kept: checkpoint folders sealed and published atomically, run locks, torch files read as data"""
