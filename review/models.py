# The ReviewItem model arrives with the review queue (cold recovery issue).
