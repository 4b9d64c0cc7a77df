"""Word lists and sentence parts for the demo corpus (see corpus.py); all written for this project.

Lists are tuples or lists iterated in written order, never sets, so generation is reproducible.
"""

from __future__ import annotations

# (name, is_female)
NAMES = [
    ("Tom", False), ("Lily", True), ("Ben", False), ("Mia", True), ("Sam", False), ("Anna", True),
    ("Max", False), ("Zoe", True), ("Leo", False), ("Ella", True), ("Jack", False), ("Lucy", True),
    ("Finn", False), ("Rosa", True), ("Omar", False), ("Nina", True), ("Ravi", False), ("Ivy", True),
    ("Hugo", False), ("Maya", True), ("Kai", False), ("Sara", True), ("Noah", False), ("Emma", True),
    ("Pip", False), ("Luna", True), ("Theo", False), ("Ruby", True), ("Eli", False), ("Daisy", True),
]  # fmt: skip

BOY_KINDS = ["boy", "cat", "dog", "bear", "rabbit", "fox", "mouse", "duck", "frog", "robot"]
GIRL_KINDS = ["girl", "cat", "dog", "bear", "rabbit", "fox", "mouse", "duck", "bird", "owl"]

CHARACTER_ADJS = [
    "happy", "kind", "brave", "little", "shy", "curious", "clever", "funny", "gentle", "busy",
    "sleepy", "friendly", "small", "quiet", "cheerful", "young", "old", "helpful",
]  # fmt: skip

PLACES = [
    "in a small house by the sea", "in a big forest", "on a green hill", "near a quiet river",
    "in a busy town", "on a farm", "in a tall tree", "in a little village", "by a blue lake",
    "in a cozy burrow", "at the edge of the woods", "in a red house with a garden",
]  # fmt: skip

TIMES = ["morning", "sunny morning", "rainy day", "cold evening", "warm afternoon", "snowy day", "windy day"]

HOBBIES = [
    "play in the park", "read books", "sing songs", "draw pictures", "build with blocks",
    "run in the grass", "splash in puddles", "look at the stars", "bake cookies", "fly a kite",
    "pick flowers", "play with a ball", "swim in the lake", "climb trees", "dance to music",
    "ride a bike", "play hide and seek", "plant seeds", "catch leaves", "watch the clouds",
]  # fmt: skip

GOALS = [
    "climb the tallest tree", "find a shiny shell", "bake a cake for mom", "see the sea",
    "visit grandma", "build a tall tower", "make a new friend", "grow a big red flower",
    "find the end of the rainbow", "cross the river", "fly like a bird", "win the race",
]  # fmt: skip

THINGS = [
    "ball", "kite", "box", "key", "hat", "book", "map", "boat", "shell", "egg", "cup", "bell", "drum", "toy",
]  # fmt: skip
THING_ADJS = ["red", "blue", "shiny", "small", "big", "old", "new", "round", "golden", "soft", "strange"]
SPOTS = [
    "under a tree", "in the garden", "on the beach", "near the pond", "in the grass",
    "behind the house", "in an old box", "under the bed", "by the road", "on a big rock",
]  # fmt: skip

# (problem sentence, what "they" did to fix it)
PROBLEMS = [
    ("But the {thing} was stuck in a tall tree.", "shook the tree until the {thing} fell down"),
    ("But then {he} lost {his} way home.", "followed the river back to the house"),
    ("Then it started to rain, and {h} got very wet.", "waited under a big leaf until the sun came out"),
    ("But {h} could not reach the top shelf.", "stood on a chair and reached the top shelf"),
    ("But the bridge over the river was broken.", "found some logs and made a new bridge"),
    ("But {his} kite was caught on the roof.", "used a long stick to get the kite back"),
    ("But a big wind blew {his} hat away.", "ran after the hat and caught it"),
    ("But the door was locked, and {h} had no key.", "looked under the mat and found the key"),
    ("But the path was dark, and {h} was scared.", "sang a song and walked slowly home"),
    ("But {his} cake fell on the floor.", "baked a new cake and shared it"),
    ("But {h} was too small to carry the box.", "carried the box all the way home"),
    ("But the little boat had a hole in it.", "fixed the hole and sailed across the lake"),
]  # fmt: skip

SAD_FEELINGS = ["sad", "worried", "upset", "scared", "tired", "lonely", "a little sad", "very worried"]
HAPPY_FEELINGS = ["happy", "very happy", "glad", "proud", "so happy", "excited", "calm", "thankful"]

ASKS = [
    '"Can you help me?" {h} asked {f} the {fk}.',
    "{h} went to see {f} the {fk} and asked for help.",
    '"Please help me, {f}," said {h}.',
    "Just then, {f} the {fk} came by.",
]
ANSWERS = [
    '"Yes, I will help you," said {f}.',
    '"Of course," said {f} with a smile.',
    '"Do not worry, I am here," said {f}.',
    '"Let us do it together," said {f}.',
    "{f} said yes and came to help {him}.",
]

MORALS = [
    "friends help each other", "it is good to share", "being kind makes everyone happy",
    "you should never give up", "it is fine to ask for help", "working together is better",
    "being brave is not easy but it is good", "a small help can mean a lot",
]  # fmt: skip

# (name, plural, sound, where it lives, food, what it can do, size, a body part)
ANIMALS = [
    ("cat", "cats", "meow", "in houses", "fish", "climb trees", "small", "soft fur and long whiskers"),
    ("dog", "dogs", "woof", "in houses", "meat", "run fast", "friendly", "a wet nose and a wagging tail"),
    ("cow", "cows", "moo", "on farms", "grass", "give milk", "big", "four legs and a long tail"),
    ("duck", "ducks", "quack", "near ponds", "seeds and bugs", "swim and fly", "small", "webbed feet"),
    ("sheep", "sheep", "baa", "on farms", "grass", "grow wool", "soft", "thick white wool"),
    ("horse", "horses", "neigh", "on farms", "hay and apples", "run very fast", "strong", "a long mane"),
    ("pig", "pigs", "oink", "on farms", "almost anything", "roll in mud", "round", "a pink snout"),
    ("owl", "owls", "hoot", "in trees", "mice", "see in the dark", "wise", "big round eyes"),
    ("frog", "frogs", "ribbit", "near ponds", "flies", "jump very far", "small", "long back legs"),
    ("lion", "lions", "roar", "on the plains", "meat", "roar very loudly", "strong", "a big mane"),
    ("bee", "bees", "buzz", "in hives", "nectar", "make honey", "tiny", "two pairs of wings"),
    ("fish", "fish", "", "in water", "small plants", "swim all day", "small", "shiny scales"),
    ("rabbit", "rabbits", "", "in burrows", "carrots and grass", "hop very fast", "small", "long ears"),
    ("elephant", "elephants", "", "on the plains", "leaves and fruit", "carry heavy logs", "very big", "a long trunk"),
    ("turtle", "turtles", "", "near the sea", "plants", "live a long time", "slow", "a hard shell"),
    ("bird", "birds", "tweet", "in trees", "seeds and worms", "fly high", "small", "feathers and wings"),
    ("mouse", "mice", "squeak", "in fields", "seeds and cheese", "hide in small holes", "tiny", "a thin tail"),
    ("bear", "bears", "", "in forests", "berries and fish", "sleep all winter", "big", "thick brown fur"),
]  # fmt: skip

# (thing, its colour)
COLOURED = [
    ("sky", "blue"), ("grass", "green"), ("sun", "yellow"), ("snow", "white"), ("night", "black"),
    ("banana", "yellow"), ("apple", "red"), ("orange", "orange"), ("leaf", "green"), ("sea", "blue"),
    ("strawberry", "red"), ("cloud", "white"), ("carrot", "orange"), ("plum", "purple"),
    ("coal", "black"), ("pumpkin", "orange"), ("lemon", "yellow"), ("frog", "green"),
]  # fmt: skip

NUMBERS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
]  # fmt: skip

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
]  # fmt: skip
SEASONS = [
    ("spring", "warm and rainy"),
    ("summer", "hot and sunny"),
    ("autumn", "cool and windy"),
    ("winter", "cold and snowy"),
]

FRUITS = ["apples", "pears", "bananas", "plums", "lemons", "oranges", "carrots", "eggs", "buns", "cookies"]
